"""When loader workers are forked (core/data/pipeline.py), and what reaches the user when one fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset

from core.config.errors import DataError, message_of
from core.data.loading import prefetch_to_device
from core.data.pipeline import TrainingData
from core.layers.context_parallel import ContextParallel
from core.training.evaluation import evaluate
from recipes.base import Datasets


class _Numbers(Dataset):
    def __init__(self, size: int, bad: int = -1):
        self.size, self.bad = size, bad

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index) -> dict:
        if index == self.bad:
            raise DataError(f"sample {index} of /data/x.bin is damaged (data.path=/data/x)")
        return {"x": torch.tensor([float(getattr(index, "idx", index))])}  # the training stream's (epoch, idx)


class _Recipe:
    def build_datasets(self) -> Datasets:
        return Datasets(_Numbers(32), _Numbers(8))

    def collate_fn(self):
        return None

    def to_device(self, batch: dict, device) -> dict:
        return batch

    def prefetch_threads(self) -> int:
        return 1

    def forward(self, model, batch, training):
        return {"loss": batch["x"].squeeze(1), "count": torch.ones(len(batch["x"]))}

    def summarize_validation(self, means: dict) -> dict:
        return means


def _worker_pids(loader: DataLoader) -> list[int]:
    iterator = loader._iterator  # the persistent workers' iterator, made at the first iter()
    return [] if iterator is None else [w.pid for w in iterator._workers]


def test_validation_workers_are_forked_before_the_first_step_and_serve_every_validation(monkeypatch):
    """The validation loader's workers start with the training loader's, before the first step, not at the
    first validation: a fork during training can meet gloo's threads holding CPython's thread-state lock
    (a deadlocked worker on CPython before 3.11.10). Every validation then uses the same processes."""
    monkeypatch.setattr("torch.distributed.all_reduce", lambda tensor, group=None: None)  # one process
    cfg = OmegaConf.create(
        {
            "seed": 3,
            "data": {"num_workers": 1, "pin_memory": False},
            "training": {
                "steps": 4,
                "epochs": None,
                "micro_batch_size": 4,
                "global_batch_size": 8,
                "limit_val_batches": -1,
            },
        }
    )
    env = SimpleNamespace(device=torch.device("cpu"), dp_size=1, dp_rank=0, context_parallel=ContextParallel)
    data = TrainingData(_Recipe(), cfg, env, accumulation=2)
    assert _worker_pids(data.val_loader) == []
    batches = data.micro_batches(0, 8)  # what train() calls before its first step
    started = _worker_pids(data.val_loader)
    assert len(started) == 1, "the validation workers were not started before the first step"
    for _ in range(2):  # a step, a validation, another step, another validation
        next(batches)
        metrics = evaluate(
            _Recipe(), torch.nn.Identity(), data.val_loader, torch.autograd.grad_mode.no_grad, env.device, None
        )
        assert metrics == {"loss": pytest.approx(3.5)}  # the mean of 0..7: every validation sample, once
        assert _worker_pids(data.val_loader) == started


def test_an_error_in_a_loader_worker_reaches_the_consumer_as_its_own_message():
    """A DataError raised in a worker comes out of the prefetching threads as that error (it was 'every thread
    ended before batch 0'), and message_of gives its own line, not the worker's traceback."""
    loader = DataLoader(_Numbers(10, bad=3), batch_size=2, num_workers=1)
    seen = []
    with pytest.raises(DataError) as raised:
        for batch in prefetch_to_device(iter(loader), torch.device("cpu"), 5):
            seen.append(batch["x"].flatten().tolist())
    assert seen == [[0.0, 1.0]]  # the batches before the failing one were handed out first
    assert message_of(raised.value) == (
        "sample 3 of /data/x.bin is damaged (data.path=/data/x) (in a data loader worker)"
    )
