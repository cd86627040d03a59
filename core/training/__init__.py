"""What a training step needs besides the model: optimizer and schedule (`optim.py`), precision
contexts (`precision.py`), the non-finite policy (`nonfinite.py`), evaluation (`evaluation.py`) and the
train state saved with every checkpoint (`state.py`)."""
