"""Processes and devices: the process group and device mesh (`env.py`), Hydra and launcher glue
(`launch.py`), save-and-stop on a scheduler's signal (`signals.py`)."""
