"""Speed options must not change what is trained: torch.compile, the profiler, and the refusals that keep
fp32 master weights."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_workers
from tests.test_parity import COMMON, _train_worker


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

    from core import compilation
    from core.layers import TORCH_LAYERS
    from recipes.vit import ViTRecipe
    from tests.helpers import compose_config
    from core.config import validate

    recipe = ViTRecipe(validate(compose_config("vit_sanity", COMMON + ["checkpoint.path=unused"])))
    model = recipe.build_model(TORCH_LAYERS, torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    torch._dynamo.reset()
    assert compilation.apply(model, recipe.unit_modules(TORCH_LAYERS)) == 2
    size, chans = recipe.cfg.model.img_size, recipe.cfg.model.in_chans
    model(torch.randn(2, chans, size, size)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # Dynamo captured the blocks
    assert [n for n, _ in model.named_parameters()] == names


def test_profiler_writes_a_trace_and_a_summary_of_the_chosen_steps(tmp_path):
    overrides = COMMON + ["distributed=fsdp2", "training.profile.enabled=true", "training.profile.start_step=2",
                          "training.profile.steps=2"]
    run_workers(1, _train_worker, overrides, str(tmp_path), False)
    trace = json.loads((tmp_path / "profile" / "rank0.trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    summary = (tmp_path / "profile" / "rank0.summary.txt").read_text()
    assert "aten::mm" in summary or "aten::addmm" in summary


def test_ddp_refuses_bf16_weights_without_a_master_copy(tmp_path):
    with pytest.raises(AssertionError, match="no fp32 master copy"):
        run_workers(1, _train_worker, COMMON + ["distributed=ddp", "precision.param_dtype=bf16"], str(tmp_path), False)
