"""The loop's decisions, step by step, without running it: which steps log, validate and save (train.train asks
core/training/schedule.py), for runs given in steps and in epochs."""

from __future__ import annotations

import itertools

import pytest

from core.training.length import RunLength, run_length
from core.training.schedule import StepSchedule


def schedule(
    steps=None,
    epochs=None,
    global_batch=4,
    dataset=10,
    log=1,
    val_steps=0,
    val_epochs=0,
    val_at_end=False,
    save_steps=0,
    save_epochs=0,
    save_final=False,
) -> StepSchedule:
    return StepSchedule(
        run_length(steps, epochs, global_batch, dataset),
        log,
        val_steps,
        val_epochs,
        val_at_end,
        save_steps,
        save_epochs,
        save_final,
    )


def steps_where(decide, schedule: StepSchedule) -> list[int]:
    return [step for step in range(1, schedule.length.steps + 1) if decide(step)]


def test_logging_every_n_steps_and_at_the_last_step():
    s = schedule(steps=25, log=10)
    assert steps_where(s.logs, s) == [10, 20, 25]
    s = schedule(steps=20, log=10)
    assert steps_where(s.logs, s) == [10, 20]


def test_validation_and_saving_by_steps_and_at_the_end():
    s = schedule(steps=25, val_steps=10, val_at_end=True, save_steps=7, save_final=True)
    assert steps_where(s.validates, s) == [10, 20, 25]
    assert steps_where(s.saves, s) == [7, 14, 21, 25]
    s = schedule(steps=25, val_steps=10, save_steps=7)  # nothing extra at the end
    assert steps_where(s.validates, s) == [10, 20]
    assert steps_where(s.saves, s) == [7, 14, 21]


def test_epoch_ends_when_the_batch_does_not_divide_the_dataset():
    """10 samples, 4 per step, 3 epochs: 8 steps; the stream passes 10, 20 and 30 samples during steps 3 (12),
    5 (20) and 8 (32), so those steps end epochs 1, 2 and 3."""
    s = schedule(epochs=3, val_epochs=1, save_epochs=2, save_final=True)
    assert s.length.steps == 8
    assert steps_where(s.validates, s) == [3, 5, 8]
    assert steps_where(s.saves, s) == [5, 8]  # the 2nd epoch's end, and the last step
    s = schedule(epochs=3, val_epochs=2)
    assert steps_where(s.validates, s) == [5]


def test_a_global_batch_larger_than_the_dataset_ends_an_epoch_every_step():
    s = schedule(epochs=4, global_batch=16, dataset=10, val_epochs=1, save_epochs=3)
    assert s.length.steps == 3 and s.length.epochs_done(3) == 4
    assert steps_where(s.validates, s) == [1, 2, 3]
    assert steps_where(s.saves, s) == [2]  # it passes 30 samples (the 3rd epoch's end) during step 2 (32)


@pytest.mark.parametrize("steps,global_batch,dataset", [(8, 1, 4), (7, 3, 10), (3, 16, 10), (30, 4, 10)])
def test_the_config_checks_answer_about_validation_agrees_with_the_loop(steps, global_batch, dataset):
    """validates_at_all() (the closed form the config check uses before any step) is true exactly when some step
    of the run validates."""
    for val_steps, val_epochs, val_at_end in itertools.product([0, 1, 5, 8, 31], [0, 1, 2, 3, 9], [False, True]):
        s = StepSchedule(RunLength(steps, global_batch, dataset), 1, val_steps, val_epochs, val_at_end, 0, 0, False)
        assert s.validates_at_all() == bool(steps_where(s.validates, s)), (val_steps, val_epochs, val_at_end)


def test_from_config_reads_the_training_and_checkpoint_keys():
    from tests.support.helpers import validated_config

    cfg = validated_config(
        "vit_sanity",
        [
            "checkpoint.path=unused",
            "training.log_every_n_steps=3",
            "training.val_every_n_steps=4",
            "training.val_every_n_epochs=2",
            "training.val_at_end=false",
            "checkpoint.save_every_n_steps=5",
            "checkpoint.save_every_n_epochs=6",
            "checkpoint.save_final=false",
        ],
    )
    s = StepSchedule.from_config(cfg, RunLength(10, 2, 7))
    assert (
        s.log_every_n_steps,
        s.val_every_n_steps,
        s.val_every_n_epochs,
        s.val_at_end,
        s.save_every_n_steps,
        s.save_every_n_epochs,
        s.save_final,
    ) == (3, 4, 2, False, 5, 6, False)
