"""The learning-rate schedule (core/training/optim.py): warmup-stable-decay (scheduler=wsd), and what a resumed run
given more training.steps does with its schedule (scheduler.on_extend): the learning rates of a 300 -> 600 extension
with each option, and the one line that says when an extension changes the rate's path."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from core.config.schema import OptimConfig, SchedulerConfig
from core.training import optim
from core.training.state import TrainState
from tests.support.checkpoint_harness import TINY
from tests.support.helpers import read_records, train_run, validated_config

LR = 2e-3


def _rates(
    cfg: SchedulerConfig, steps: int, stopped_at: int, extended_to: int, recorded: int | None = None
) -> tuple[list[float], list[str]]:
    """The learning rate of each step 1..extended_to of a run of `steps` stopped after `stopped_at` (its scheduler's
    state saved and loaded into a fresh one, as a checkpoint does), resumed with training.steps=extended_to; and
    what the resume warns. `recorded`: the schedule length the checkpoint records (0: one of an earlier version)."""
    cfg = OmegaConf.structured(cfg)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=LR)
    scheduler = optim.build_scheduler(optimizer, cfg, steps)
    rates = []
    for _ in range(stopped_at):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()
    optimizer = torch.optim.AdamW([weight], lr=LR)
    scheduler = optim.build_scheduler(optimizer, cfg, extended_to)
    scheduler.load_state_dict(saved)
    state = TrainState(step=stopped_at, schedule_steps=steps if recorded is None else recorded)
    notes = optim.resume_schedule(
        optimizer, scheduler, OmegaConf.structured(OptimConfig(lr=LR)), cfg, state, extended_to
    )
    for _ in range(stopped_at, extended_to):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates, notes


def _at(rates: list[float], step: int) -> float:
    return rates[step - 1]  # rates[0] is step 1's


def test_wsd_is_constant_after_its_warmup_until_its_decay():
    cfg = SchedulerConfig(name="wsd", warmup_steps=30)  # decay_fraction 0.2: the last 60 of 300 steps
    multipliers = [optim.lr_multiplier(s, 300, cfg) for s in range(320)]
    assert multipliers[0] == pytest.approx(1 / 30) and multipliers[29] == 1.0
    assert all(m == 1.0 for m in multipliers[29:240])
    assert multipliers[240:300] == pytest.approx([1 - k / 60 for k in range(60)])
    assert all(m == 0.0 for m in multipliers[300:])  # past the end: the final rate
    by_steps = SchedulerConfig(name="wsd", warmup_steps=30, decay_steps=50, min_lr_ratio=0.1)
    assert optim.decay_start(300, by_steps) == 250 and optim.lr_multiplier(249, 300, by_steps) == 1.0
    assert optim.lr_multiplier(275, 300, by_steps) == pytest.approx(0.1 + 0.9 * 0.5)


def test_a_finished_cosine_extended_from_300_to_600_steps_rises_again_and_says_so():
    """The README's `training.steps=600` after 300 steps: the cosine stretched over 600 steps (scheduler.on_extend=
    stretch, the default), so step 301's rate is 1.08e-3 where the 300-step run ended near 0."""
    rates, notes = _rates(SchedulerConfig(name="cosine", warmup_steps=30), 300, 300, 600)
    assert _at(rates, 300) == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 269 / 270)))  # 6.77e-08
    assert _at(rates, 301) == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 270 / 570)))  # 1.08e-03
    assert _at(rates, 600) == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 569 / 570)))
    assert len(notes) == 1 and "\n" not in notes[0]
    assert notes[0].startswith(
        "the learning rate at step 301 is 0.00108, not the 0 the checkpoint's run would have "
        "used: the cosine schedule now spans training.steps=600, not the 300 it started with."
    )
    assert "scheduler.on_extend=hold" in notes[0] and "scheduler=wsd" in notes[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cosine", "wsd"])
def test_hold_keeps_the_finished_decay(name):
    rates, notes = _rates(
        SchedulerConfig(name=name, warmup_steps=30, on_extend="hold", min_lr_ratio=0.1), 300, 300, 600
    )
    assert rates[300:] == [pytest.approx(0.1 * LR)] * 300  # steps 301-600 at the final rate
    assert notes == [
        "scheduler.on_extend=hold: the schedule ended at step 300; steps 301-600 keep its final learning "
        "rate 0.0002 (scheduler.min_lr_ratio=0.1 x optim.lr)"
    ]
    _, idle = _rates(SchedulerConfig(name=name, warmup_steps=30, on_extend="hold"), 300, 300, 600)
    assert idle[0].endswith(
        "keep its final learning rate 0 (scheduler.min_lr_ratio=0.0 x optim.lr): they change "
        "nothing (weight decay too is scaled by the rate)"
    )


def test_a_wsd_run_extended_before_its_decay_goes_on_as_if_it_had_been_asked_for_600_steps():
    """Stopped at step 200 of 300 (the decay starts after step 240) and extended to 600: no change, no warning, and
    the rates are those of a run of 600 steps from the start."""
    cfg = SchedulerConfig(name="wsd", warmup_steps=30)
    rates, notes = _rates(cfg, 300, 200, 600)
    assert notes == []
    assert rates[29:480] == [LR] * 451 and _at(rates, 481) == LR and _at(rates, 482) < LR
    whole, _ = _rates(cfg, 600, 600, 600)
    assert rates == whole


def test_a_finished_wsd_extended_says_its_decay_had_begun():
    rates, notes = _rates(SchedulerConfig(name="wsd", warmup_steps=30), 300, 300, 600)
    assert _at(rates, 300) == pytest.approx(LR / 60) and rates[300:480] == [LR] * 180
    assert len(notes) == 1 and "at step 301 is 0.002, not the 0" in notes[0]
    assert (
        "the wsd schedule now spans training.steps=600, not the 300 it started with, and its decay had begun (at "
        "step 241): the rate is back at the stable rate, and decays again from step 481"
    ) in notes[0]


def test_a_checkpoint_without_the_schedules_length_stretches_and_says_why():
    rates, notes = _rates(SchedulerConfig(name="cosine", warmup_steps=30, on_extend="hold"), 300, 300, 600, recorded=0)
    assert _at(rates, 301) == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 270 / 570)))
    assert notes[0].startswith("scheduler.on_extend=hold: the checkpoint does not record the length of its schedule")
    assert "the checkpoint does not record the length its schedule started with" in notes[1]


@pytest.mark.slow
def test_an_extended_training_run_warns_and_holds(tmp_path, caplog):
    """train.py's run from its parts: a 6-step run extended to 10 steps warns in one line with the old and new rate
    and trains at the stretched schedule's rates; extended again with scheduler.on_extend=hold (which does not make
    it another run), its steps past the recorded end keep the final rate."""
    tiny = TINY + [f"checkpoint.path={tmp_path}/ckpt", "scheduler.warmup_steps=2"]
    train_run(validated_config("vit_sanity", tiny + ["training.steps=6"]), tmp_path / "run")
    caplog.clear()
    train_run(validated_config("vit_sanity", tiny + ["training.steps=10"]), tmp_path / "run")
    cfg = validated_config("vit_sanity", tiny + ["training.steps=10"]).scheduler
    stretched = 3e-3 * optim.lr_multiplier(6, 10, cfg)
    warned = [r.getMessage() for r in caplog.records if "learning rate at step 7" in r.getMessage()]
    assert warned == [
        f"the learning rate at step 7 is {stretched:.3g}, not the 0 the checkpoint's run would have used: "
        "the cosine schedule now spans training.steps=10, not the 6 it started with. scheduler.on_extend="
        "hold keeps the schedule it started with (steps past its end at its final rate); a scheduler=wsd "
        "run extended before its decay begins goes on at the same rate"
    ]
    train_run(
        validated_config("vit_sanity", tiny + ["training.steps=12", "scheduler.on_extend=hold"]), tmp_path / "run"
    )
    rates = {r["step"]: r["lr"] for r in read_records(tmp_path / "run") if "lr" in r}
    assert rates[7] == pytest.approx(stretched) and rates[10] > 0
    assert rates[11] == rates[12] == 0.0  # held at the 10-step schedule's end


def test_a_warmup_longer_than_the_run_or_a_wsd_decay_that_does_not_fit_is_said():
    """Without a word, a warmup of 30 over a 2-step run trains at 1/15 of optim.lr at most, and a wsd decay longer than
    the steps after the warmup is cut short."""
    assert optim.schedule_notes(SchedulerConfig(warmup_steps=30), LR, 2) == [
        "scheduler.warmup_steps=30 spans the whole run of 2 steps: the learning rate rises to 0.000133 at most "
        "(optim.lr=0.002) and never decays (set scheduler.warmup_steps below the run's steps)"
    ]
    assert optim.schedule_notes(SchedulerConfig(warmup_steps=30), LR, 31) == []
    wsd = SchedulerConfig(name="wsd", warmup_steps=30, decay_steps=50)
    assert optim.schedule_notes(wsd, LR, 60) == [
        "scheduler.decay_steps=50 does not fit in the run's 60 steps after scheduler.warmup_steps=30: the decay "
        "spans only the last 30 steps"
    ]
    assert optim.schedule_notes(wsd, LR, 80) == []
    assert (
        "scheduler.decay_fraction=0.2 (6 steps) does not fit"
        in optim.schedule_notes(SchedulerConfig(name="wsd", warmup_steps=30), LR, 32)[0]
    )


def test_a_run_whose_warmup_spans_it_warns_before_its_first_step(tmp_path, caplog):
    overrides = ["training.steps=2", "scheduler.warmup_steps=10", f"checkpoint.path={tmp_path}/ckpt"]
    train_run(validated_config("points", overrides), tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("scheduler.warmup_steps=10 spans")]
    assert len(said) == 1 and "rises to 0.002 at most (optim.lr=0.01)" in said[0]
