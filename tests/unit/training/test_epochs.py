"""training.epochs: the run's length in passes over the training set; validation and saving by epoch."""

from __future__ import annotations

from collections import Counter

import pytest

from core.training.length import run_length
from tests.support.checkpoint_harness import phase, run_phases
from tests.support.helpers import read_records, run_workers

# TINY: 48 training samples, global batch 16, so an epoch is 3 steps.
BY_EPOCHS = [
    "training.steps=null",
    "training.epochs=2",
    "training.val_every_n_epochs=1",
    "checkpoint.save_every_n_epochs=1",
    "checkpoint.save_final=false",
]


@pytest.mark.slow
def test_two_epochs_train_every_sample_exactly_twice_and_validate_and_save_at_each_epoch_end(tmp_path):
    ((whole, stopped, resumed),) = run_workers(
        1,
        run_phases,
        [
            phase(tmp_path, "whole", "ckpt_whole", BY_EPOCHS),
            phase(tmp_path, "run", "ckpt", BY_EPOCHS, signal_at=1),  # SIGTERM during step 1: saves step 2 and stops
            phase(tmp_path, "run", "ckpt", BY_EPOCHS),
        ],
    )
    assert sorted(whole["losses"]) == [1, 2, 3, 4, 5, 6]
    trained = [i for micro_batch in whole["idx"] for i in micro_batch]
    assert Counter(trained) == {i: 2 for i in range(48)}  # two passes, nothing more
    first, second = trained[:48], trained[48:]
    assert sorted(first) == sorted(second) == list(range(48)) and first != second  # reshuffled per epoch
    records = read_records(tmp_path / "whole")
    assert [r["step"] for r in records if r.get("split") == "val"] == [3, 6]
    assert sorted(p.name for p in (tmp_path / "ckpt_whole").glob("step_*")) == ["step_3", "step_6"]
    # Stopped and resumed by epochs: the same length, the same losses.
    assert stopped["stopped_by"] == "SIGTERM" and resumed["start_step"] == 2
    assert {**stopped["losses"], **resumed["losses"]} == whole["losses"]


def test_epochs_to_steps_and_epoch_ends():
    exact = run_length(None, 2, 16, 48)
    assert exact.steps == 6 and [s for s in range(1, 7) if exact.ends_epoch(s, 1)] == [3, 6]
    assert [s for s in range(1, 7) if exact.ends_epoch(s, 2)] == [6]
    assert "6 steps of 16 samples over 48" in exact.describe(2) and "also takes" not in exact.describe(2)
    assert run_length(None, 2, 16, 40).steps == 5  # 80 samples: the global batch divides two epochs
    over = run_length(None, 3, 16, 40)  # 120 samples -> 8 steps = 128: 8 samples of epoch 4
    assert over.steps == 8 and "also takes 8 samples of epoch 4" in over.describe(3)
    assert [s for s in range(1, 9) if over.ends_epoch(s, 1)] == [3, 5, 8]  # after 48, 80 and 128 samples
    huge = run_length(None, 4, 100, 30)  # a global batch larger than the data: epochs end several at a step
    assert [s for s in range(1, huge.steps + 1) if huge.ends_epoch(s, 2)] == [1, 2]
    assert run_length(7, None, 16, 48).steps == 7
