"""Speed options must not change what is trained: torch.compile, the profiler, and the refusals that keep
fp32 master weights."""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from tests.e2e.test_parity import COMMON, MICRO, _train_worker
from tests.support.helpers import REPO, run_workers


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_blocks(tmp_path):
    """training.compile=true compiles each block's forward: same parameter names (checkpoints), same
    losses and final weights as eager up to fused-kernel rounding."""
    base = COMMON + ["distributed=fsdp2"]
    eager = run_workers(1, _train_worker, base, str(tmp_path / "eager"), False)[0]
    compiled = run_workers(1, _train_worker, base + ["training.compile=true"], str(tmp_path / "compiled"), False)[0]
    assert compiled["state"].keys() == eager["state"].keys()
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    for name, value in eager["state"].items():
        diff = (compiled["state"][name] - value).norm() / value.norm().clamp_min(1e-12)
        assert diff < 1e-3, name
    assert not any("_orig_mod" in name for name in compiled["state"])


def test_compile_replaces_each_block_forward_and_runs_compiled():
    import torch
    import torch._dynamo

    from core.layers.namespace import TORCH_LAYERS
    from core.parallel import compilation
    from recipes.vit.recipe import ViTRecipe
    from tests.support.helpers import validated_config

    recipe = ViTRecipe(validated_config("vit_sanity", COMMON + ["checkpoint.path=unused"]))
    model = recipe.build_model(TORCH_LAYERS, torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    torch._dynamo.reset()
    assert compilation.apply(model, recipe.unit_modules(TORCH_LAYERS)) == 2
    size, chans = recipe.cfg.model.img_size, recipe.cfg.model.in_chans
    # The shapes the test above compiled for: inductor's on-disk cache can serve this one.
    model(torch.randn(MICRO, chans, size, size)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # Dynamo captured the blocks
    assert [n for n, _ in model.named_parameters()] == names


@pytest.mark.slow
def test_profiler_writes_a_trace_and_a_summary_of_the_chosen_steps(tmp_path):
    overrides = COMMON + [
        "distributed=fsdp2",
        "training.profile.enabled=true",
        "training.profile.start_step=2",
        "training.profile.steps=2",
    ]
    run_workers(1, _train_worker, overrides, str(tmp_path), False)
    trace = json.loads((tmp_path / "profile" / "rank0.trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    summary = (tmp_path / "profile" / "rank0.summary.txt").read_text()
    assert "aten::mm" in summary or "aten::addmm" in summary


@pytest.mark.slow
def test_ddp_refuses_bf16_weights_without_a_master_copy(tmp_path):
    with pytest.raises(AssertionError, match="no fp32 master copy"):
        run_workers(1, _train_worker, COMMON + ["distributed=ddp", "precision.param_dtype=bf16"], str(tmp_path), False)


def test_trace_gaps_reports_busy_time_kinds_and_idle_gaps(tmp_path, capsys, monkeypatch):
    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "FusedRoPEFunc", "ts": 600, "dur": 50, "tid": 1},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 10,
            "dur": 5,
            "tid": 1,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 610,
            "dur": 5,
            "tid": 1,
            "args": {"correlation": 3},
        },
        kernel("nvjet_sm90_gemm", 100, 200, 1),  # 100-300
        kernel("vectorized_elementwise_kernel<add>", 250, 150, 2),  # overlaps: busy 100-400
        kernel("fused_rope_forward_kernel", 700, 100, 3),  # 700-800
    ]
    trace = tmp_path / "rank0.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    monkeypatch.setattr(sys, "argv", ["trace_gaps.py", str(trace), "--min-gap-ms", "0.15"])
    runpy.run_path(str(REPO / "benchmarks" / "trace_gaps.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "ProfilerStep#3: wall 1.0 ms, GPU busy 0.4 ms (40%), 3 GPU activities" in out
    assert "gemm" in out and "rope" in out and "elementwise/other" in out
    # 400-700 before the RoPE kernel (launched in FusedRoPEFunc) and 800-1000 at the end; 0-100 is too short.
    assert "idle gaps >= 0.15 ms: 2, 0.5 ms in total" in out
    assert "0.30 ms at +    0.4 ms  before fused_rope_forward_kernel (launched in FusedRoPEFunc)" in out


def test_throughput_global_batch_accumulates_like_a_real_run(tmp_path, monkeypatch):
    """benchmarks/throughput.py --global-batch: every run trains that global batch (accumulating micro-batches)
    and its rows say how many; a global batch the micro-batches do not divide is refused before any run."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import train_runs

    runs = []

    def fake_run_train(config, nproc, overrides, timeout=None, gpus=None):
        runs.append(overrides)
        timed = {
            "step": 6,
            "samples_per_sec_per_gpu": 50.0,
            "tokens_per_sec_per_gpu": 102400.0,
            "step_time": 2.5,
            "data_wait": 0.0,
            "peak_mem_gib": 48.0,
        }
        return [{"step": 3}, timed], ""

    monkeypatch.setattr(train_runs, "run_train", fake_run_train)
    script = str(REPO / "benchmarks" / "throughput.py")
    common = [
        "throughput.py",
        "--config",
        "gpt_1b",
        "--data",
        "gpt_mock",
        "--nproc",
        "1",
        "--steps",
        "3",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", common + ["--micro-batch", "16", "32", "--global-batch", "128"])
    runpy.run_path(script, run_name="__main__")
    assert len(runs) == 2
    for overrides, micro in zip(runs, (16, 32)):
        assert f"training.micro_batch_size={micro}" in overrides and "training.global_batch_size=128" in overrides
    (written,) = tmp_path.glob("gpt_1b-1gpu-*.json")
    rows = json.loads(written.read_text())["results"]
    assert [(r["micro_batch"], r["accumulation"]) for r in rows] == [(16, 8), (32, 4)]

    # Without --global-batch: one micro-batch per step.
    runs.clear()
    monkeypatch.setattr(sys, "argv", common + ["--micro-batch", "16"])
    runpy.run_path(script, run_name="__main__")
    assert "training.global_batch_size=16" in runs[0]

    runs.clear()
    monkeypatch.setattr(sys, "argv", common + ["--micro-batch", "48", "--global-batch", "128"])
    with pytest.raises(SystemExit) as refused:
        runpy.run_path(script, run_name="__main__")
    assert refused.value.code == 2 and runs == []

    # Context- and tensor-parallel ranks share samples: 8 processes at cp=2 x tp=2 are 2 data-parallel ranks, so a
    # global batch of 8 at micro-batch 1 accumulates 4 (and without --global-batch a step takes 2 samples).
    runs.clear()
    eight = [a if a != "1" else "8" for a in common] + ["--micro-batch", "1"]
    variant = ["--variant", "cp2tp2=distributed.cp=2 distributed.tp=2"]
    monkeypatch.setattr(sys, "argv", eight + ["--global-batch", "8"] + variant)
    runpy.run_path(script, run_name="__main__")
    (written,) = tmp_path.glob("gpt_1b-8gpu-*.json")
    assert json.loads(written.read_text())["results"][0]["accumulation"] == 4
    monkeypatch.setattr(sys, "argv", eight + variant)
    runpy.run_path(script, run_name="__main__")
    assert "training.global_batch_size=2" in runs[-1]


def test_throughput_variant_overrides_win_over_extra_and_a_failing_run_reports_its_rank_error(tmp_path, monkeypatch):
    """A variant's own overrides follow --extra's (Hydra keeps a key's last value: the variant's wins), and a run
    that fails reports the failing rank's error line, not torchrun's report that a rank failed."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import train_runs

    launcher_report = (
        "[rank0]: Traceback (most recent call last):\n[rank0]:   File train.py, line 9\n"
        "[rank0]: core.config.errors.ConfigError: model.seq_length=4096 is too long for this\n"
        "E1128 00:00:00.000 12 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 1)\n"
        "Traceback (most recent call last):\n  File torch/distributed/run.py, line 1, in main\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n====\ntrain.py FAILED\n"
    )
    assert train_runs.rank_error(launcher_report).splitlines()[-1].endswith("is too long for this")
    assert train_runs.rank_error("just one line") == "just one line"
    # The table's line names the error even where a library printed a warning after it.
    logged = "[2026-12-02][train][ERROR] - data error: data.root=/x: /x/index.json: no such file"
    assert (
        train_runs.error_headline(f"{logged}\n/te/__init__.py:130: RuntimeWarning: no Jax\n  warnings.warn(\n")
        == logged
    )
    assert train_runs.error_headline(train_runs.rank_error(launcher_report)) == (
        "core.config.errors.ConfigError: model.seq_length=4096 is too long for this"
    )
    oom = "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n[rank0]: See docs"
    assert train_runs.error_headline(oom).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert train_runs.error_headline("x\nAssertionError\nsome note") == "AssertionError"
    assert train_runs.error_headline("nothing named\nat all\n") == "at all"

    runs = []

    def fake_run_train(config, nproc, overrides, timeout=None, gpus=None):
        runs.append(overrides)
        raise train_runs.TrainRunFailed("cmd failed:\n" + train_runs.rank_error(launcher_report))

    monkeypatch.setattr(train_runs, "run_train", fake_run_train)
    monkeypatch.setattr(
        sys,
        "argv",
        ["throughput.py", "--config", "gpt_1b", "--nproc", "1", "--steps", "3", "--out", str(tmp_path)]
        + ["--extra", "model.seq_length=2048 data.num_workers=2", "--variant", "long=model.seq_length=4096"],
    )
    runpy.run_path(str(REPO / "benchmarks" / "throughput.py"), run_name="__main__")
    (overrides,) = runs
    seq = [o for o in overrides if o.startswith("model.seq_length=")]
    assert seq[-1] == "model.seq_length=4096" and "data.num_workers=2" in overrides
    (written,) = tmp_path.glob("gpt_1b-1gpu-*.json")
    (row,) = json.loads(written.read_text())["results"]
    assert row["error"].splitlines()[-1].endswith("ConfigError: model.seq_length=4096 is too long for this")
