import importlib.util

import pytest
import torch

if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None:
    # TE loads cuDNN's libraries itself: once a test has made torch load its own cuDNN first, TE's load can
    # pick up a mismatched system copy on some images ("undefined symbol ... libcudnn_graph.so.9"), as
    # train.py never does (it imports TE before any cuDNN call). Import it first here as well.
    import transformer_engine.pytorch  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
