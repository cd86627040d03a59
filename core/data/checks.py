"""Check that a dataset is deterministic, as Megatron-style training needs; usable in users' own tests.

from core.data.checks import assert_dataset_deterministic
assert_dataset_deterministic(my_dataset, indices=range(10))
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Optional

import numpy as np
import torch


def _global_rng_states() -> dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _changed_rngs(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changed = []
    for name in before:
        a, b = before[name], after.get(name)
        if name == "numpy":
            same = a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])
        elif name == "cuda":
            same = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        elif name == "torch":
            same = torch.equal(a, b)
        else:
            same = a == b
        if not same:
            changed.append(name)
    return changed


def _first_difference(a: Any, b: Any, path: str) -> Optional[str]:
    """Where two outputs differ ("sample['image']: values differ"), or None when equal."""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        return (
            None
            if torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
            else f"{path}: values differ"
        )
    if isinstance(a, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        return None if np.array_equal(a, b, equal_nan=a.dtype.kind in "fc") else f"{path}: values differ"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            found = _first_difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) and a != a and b != b:  # NaN == NaN here
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def assert_dataset_deterministic(dataset: Any, indices: Optional[Iterable[Any]] = None, num_samples: int = 8) -> None:
    """Fetch every index twice and fail, naming the index and the field, when the two samples differ
    or when fetching changed the global torch / numpy / python (/ CUDA) RNG state.

    `indices` default to `num_samples` indices spread over the dataset (ints, or whatever the dataset
    takes, e.g. EpochIndex)."""
    if indices is None:
        n = len(dataset)
        indices = sorted({round(i * (n - 1) / max(num_samples - 1, 1)) for i in range(min(num_samples, n))})
    for index in indices:
        before = _global_rng_states()
        first = dataset[index]
        after_first = _global_rng_states()
        second = dataset[index]
        changed = sorted(
            set(_changed_rngs(before, after_first)) | set(_changed_rngs(after_first, _global_rng_states()))
        )
        if changed:
            raise AssertionError(
                f"dataset[{index!r}] changed the global {', '.join(changed)} RNG state: derive "
                "randomness from the index (core.data.datasets.sample_generator), not the global RNGs"
            )
        difference = _first_difference(first, second, "sample")
        if difference:
            raise AssertionError(f"dataset[{index!r}] differs between two calls at {difference}")


# The name BioNeMo users know.
assert_dataset_compatible_with_megatron = assert_dataset_deterministic
