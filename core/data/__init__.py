"""Data for the loop: the global batch split over ranks (`sampling.py`), loaders and device prefetch
(`loading.py`), the training and validation pipelines (`pipeline.py`), deterministic dataset utilities
(`datasets.py`) and their checker (`checks.py`)."""
