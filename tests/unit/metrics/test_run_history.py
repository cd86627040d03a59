"""One run, one history: however often a run's command runs (stopped by a signal and resumed, sent back to an
older checkpoint, extended with more steps), its run directory, metrics.jsonl, W&B run and TensorBoard
events read as the one uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.distributed.launch import run_name
from core.metrics.history import keep_history_up_to
from tests.support.checkpoint_harness import phase, run_phases
from tests.support.helpers import REPO, run_python, run_workers

LOGGERS = [
    "logger.wandb.enabled=true",
    "logger.wandb.mode=offline",
    "logger.tensorboard.enabled=true",
    "training.val_every_n_steps=2",
    "checkpoint.save_every_n_steps=2",
]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _history(run_dir: Path) -> list[tuple]:
    """(split, step, the figures that do not depend on timing) of every record, in file order."""
    timing = {
        "step_time",
        "data_wait",
        "samples_per_sec_per_gpu",
        "tokens_per_sec_per_gpu",
        "peak_mem_gib",
        "mfu",
        "stall_s",
    }
    return [
        (r.get("split", "train"), r["step"], sorted((k, v) for k, v in r.items() if k not in timing | {"step"}))
        for r in _records(run_dir / "metrics.jsonl")
    ]


def _tensorboard(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars(tag)]
    assert len(steps) == len(set(steps)), steps  # each step once: the purged events are gone
    return {e.step: e.value for e in events.Scalars(tag)}


@pytest.mark.slow
def test_stopped_resumed_and_sent_back_runs_keep_one_history(tmp_path):
    run = tmp_path / "run"
    ckpt = tmp_path / "ckpt"
    ((ref, stopped, resumed, again),) = run_workers(
        1,
        run_phases,
        [
            phase(tmp_path, "ref", "ckpt_ref", LOGGERS),
            phase(tmp_path, "run", "ckpt", LOGGERS, signal_at=3),  # SIGTERM: saves step 4 and stops
            phase(tmp_path, "run", "ckpt", LOGGERS),  # the same command again: steps 5-8
            phase(tmp_path, "run", "ckpt", LOGGERS, remove=[ckpt / "step_8", ckpt / "step_6"]),  # back to step 4
        ],
    )
    assert stopped["stopped_by"] == "SIGTERM" and resumed["start_step"] == 4 and again["start_step"] == 4
    history = _history(run)
    assert history == _history(tmp_path / "ref")  # one record per step and split, the uninterrupted run's figures
    superseded = _records(run / "metrics.superseded.jsonl")  # steps 5-8 of the second invocation, kept aside
    assert sorted({r["step"] for r in superseded}) == [5, 6, 7, 8]
    record = json.loads((ckpt / "run.json").read_text())
    assert record["run_dir"] == str(run.resolve())
    offline_runs = sorted((run / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, with a suffix when two invocations start in the same second: one id for all three
    assert len(offline_runs) == 3 and all(f"-{record['wandb_id']}" in p.name for p in offline_runs)
    tb, tb_ref = _tensorboard(run, "train/loss"), _tensorboard(tmp_path / "ref", "train/loss")
    assert sorted(tb) == list(range(1, 9)) and tb == tb_ref
    val = {r[1]: dict(r[2])["loss"] for r in history if r[0] == "val"}  # metrics.jsonl's validation losses
    assert sorted(val) == [2, 4, 6, 8] and _tensorboard(run, "val/loss") == pytest.approx(val, rel=1e-6)


def test_keep_history_up_to_moves_later_and_broken_lines_aside(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": 1.5},
        {"step": 2, "loss": 1.4, "split": "val"},
        {"step": 3, "loss": 1.2},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')
    assert keep_history_up_to(metrics, 2) == 2
    assert _records(metrics) == lines[:3]
    assert (tmp_path / "metrics.superseded.jsonl").read_text().splitlines() == [json.dumps(lines[3]), '{"step": 4, "lo']
    assert keep_history_up_to(metrics, 2) == 0 and keep_history_up_to(tmp_path / "none.jsonl", 0) == 0


@pytest.mark.slow
def test_the_same_command_again_continues_in_the_same_run_dir(tmp_path):
    """Without hydra.run.dir on the command line: the second invocation (more steps) finds the run directory of
    the first through checkpoint.path's run.json; predict.py of the same config gets a directory of its own."""
    tiny = [
        "data.num_workers=0",
        "model.hidden_size=32",
        "model.depth=1",
        "model.num_heads=2",
        "training.global_batch_size=8",
        "training.micro_batch_size=8",
        "training.log_every_n_steps=1",
        "logger.progress_bar=never",
    ]

    def invoke(entry: str, *extra: str) -> None:
        proc = run_python(REPO / entry, "--config-name", "vit_sanity", *tiny, *extra, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    invoke("train.py", "training.steps=3")
    invoke("train.py", "training.steps=5")
    # The model overrides make a run of its own: its checkpoints and run directories in outputs/vit_sanity/<them>/.
    folder = tmp_path / "outputs" / "vit_sanity" / run_name(tiny)
    runs = [p for p in folder.iterdir() if p.name != "checkpoints"]
    assert len(runs) == 1 and [p.name for p in (tmp_path / "outputs" / "vit_sanity").iterdir()] == [folder.name]
    assert [r["step"] for r in _records(runs[0] / "metrics.jsonl") if "split" not in r] == [1, 2, 3, 4, 5]
    assert (runs[0] / "train.log").read_text().count("global batch 8") == 2  # both invocations' logs, one file
    invoke("predict.py", f"checkpoint.init_from={folder}/checkpoints/step_5", "predict.split=val")
    assert len([p for p in (tmp_path / "outputs" / "vit_sanity").iterdir() if p.name != folder.name]) == 1
