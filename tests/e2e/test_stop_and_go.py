"""Resuming: a run stopped and started again equals an uninterrupted one, bit for bit; checkpoints move
between world sizes and backends without repeating or skipping a sample."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.support.checkpoint_harness import phase, run_phases
from tests.support.helpers import run_workers

DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]  # so the RNG state matters too


@pytest.mark.parametrize(
    "backend,shim,extra",
    [
        pytest.param(
            "fsdp2", False, ["checkpoint.async_save=true", "checkpoint.save_every_n_steps=3"], id="fsdp2-async"
        ),
        pytest.param("ddp", False, [], id="ddp"),
        pytest.param("mfsdp", True, ["distributed.mfsdp.zero_dp_strategy=3"], id="mfsdp-zero3"),
    ],
)
@pytest.mark.slow
def test_stop_and_go_equals_uninterrupted_run(backend, shim, extra, tmp_path):
    """Stopped by SIGTERM (sent to rank 0 only) after step 4 and started again with the same config:
    steps 5-8 cross the end of warmup (step 5) and an epoch boundary (step 6) and match exactly."""
    common = DROPOUT + [f"distributed={backend}"] + extra
    ranks = run_workers(
        2,
        run_phases,
        [
            phase(tmp_path, "ref", "ckpt_ref", common),
            phase(tmp_path, "stopped", "ckpt", common, signal_at=3),
            phase(tmp_path, "resumed", "ckpt", common),
        ],
        shim,
    )
    ref, stopped, resumed = ranks[0]
    assert sorted(ref["losses"]) == list(range(1, 9))
    assert stopped["stopped_by"] == "SIGTERM" and max(stopped["losses"]) == 4
    assert ranks[1][1]["stopped_by"] == "a signal on another rank"  # it agreed to stop at the same step
    # The samples the 2 ranks trained on in steps 1-3 and 4-6 (2 micro-batches each per step) are
    # each a permutation of the 48 images: epoch 0, then epoch 1, in another order.
    epochs = [[i for r in ranks for batch in r[0]["idx"][6 * e : 6 * e + 6] for i in batch] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(48)) and epochs[0] != epochs[1]
    assert (tmp_path / "ckpt" / "step_4" / "COMPLETE").exists()
    assert resumed["start_step"] == 4
    interrupted = stopped["losses"] | resumed["losses"]
    assert interrupted == ref["losses"]  # bit for bit, every step


def _stream(start_step: int, end_step: int, global_batch: int = 16) -> Counter:
    """Positions of the global sample stream that steps start_step+1 .. end_step consume, once each."""
    return Counter(range(start_step * global_batch, end_step * global_batch))


def _trained_on(result: dict) -> Counter:
    return Counter(i for batch in result["samples"] for i in batch)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_resume_on_another_world_size(before, after, tmp_path):
    """Saved on `before` ranks after step 4, resumed on `after`: every sample of the stream is trained
    on exactly once (positions of the stream: 2 epochs + 2 steps), and the losses continue those of an
    uninterrupted run."""
    ref_and_first = run_workers(
        before,
        run_phases,
        [
            phase(tmp_path, "ref", "ckpt_ref", ["distributed=fsdp2"]),
            phase(tmp_path, "first", "ckpt", ["distributed=fsdp2"], signal_at=3),
        ],
    )
    second = run_workers(after, run_phases, [phase(tmp_path, "second", "ckpt", ["distributed=fsdp2"])])
    ref, first = ref_and_first[0]
    assert max(first["losses"]) == 4 and second[0][0]["start_step"] == 4
    first_samples = sum((_trained_on(r[1]) for r in ref_and_first), Counter())
    second_samples = sum((_trained_on(r[0]) for r in second), Counter())
    assert first_samples == _stream(0, 4)
    assert second_samples == _stream(4, 8)  # nothing repeated, nothing skipped
    for step in range(5, 9):  # another reduction order: equal to rounding
        assert second[0][0]["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-5)


@pytest.mark.slow
def test_checkpoints_move_between_mfsdp_and_fsdp2(tmp_path):
    """An mfsdp (ZeRO-3) checkpoint resumes under fsdp2 and an fsdp2 one under mfsdp; both continue the
    uninterrupted mfsdp run's losses (the backends agree to rounding)."""
    mfsdp, fsdp2 = ["distributed=mfsdp"], ["distributed=fsdp2"]
    ref, _, m_to_f, _, f_to_m = run_workers(
        2,
        run_phases,
        [
            phase(tmp_path, "ref", "ckpt_ref", mfsdp),
            phase(tmp_path, "m", "ckpt_m", mfsdp, signal_at=3),
            phase(tmp_path, "m_to_f", "ckpt_m", fsdp2),
            phase(tmp_path, "f", "ckpt_f", fsdp2, signal_at=3),
            phase(tmp_path, "f_to_m", "ckpt_f", mfsdp),
        ],
        True,
    )[0]
    for resumed in (m_to_f, f_to_m):
        assert resumed["start_step"] == 4 and sorted(resumed["losses"]) == [5, 6, 7, 8]
        for step, loss in resumed["losses"].items():
            assert loss == pytest.approx(ref["losses"][step], rel=1e-5)


@pytest.mark.slow
def test_a_checkpoint_written_by_the_previous_code_resumes_exactly(tmp_path):
    """tests/support/fixtures/previous_main: step_4 of a 2-rank fsdp2 run with dropout, saved by the code before the
    checkpointing package (commit 18e2495), and that code's losses for the uninterrupted 8 steps. This code
    resumes it and continues with those losses (bit for bit on the machine that wrote them; 1e-6 leaves room
    for another CPU's kernels)."""
    import json
    import shutil

    from tests.support.helpers import REPO

    fixture = REPO / "tests" / "support" / "fixtures" / "previous_main"
    shutil.copytree(fixture / "step_4", tmp_path / "ckpt" / "step_4")
    expected = {int(k): v for k, v in json.loads((fixture / "losses.json").read_text())["losses"].items()}
    resumed = run_workers(2, run_phases, [phase(tmp_path, "resumed", "ckpt", DROPOUT + ["distributed=fsdp2"])])[0][0]
    assert resumed["start_step"] == 4 and resumed["resumed_from"] == str(tmp_path / "ckpt" / "step_4")
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(expected[step], rel=1e-6, abs=0), step
    print("resumed losses", resumed["losses"], "previous code's", {s: expected[s] for s in range(5, 9)})
