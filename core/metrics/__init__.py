"""Where numbers go: the logger (`logger.py`), the throughput meter (`meter.py`), device facts
(`hardware.py`) and the profiler (`profiling.py`); task figures over every item (`task_metrics.py`)."""
