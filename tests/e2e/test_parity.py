"""Every data-parallel backend, with 2 gloo processes and gradient accumulation, must train exactly like a
plain single-process PyTorch loop over the whole global batch (same losses, same final weights).

The reference below is written independently of train.py: one forward over all G samples of a step,
mean loss, clip, AdamW with decay/no-decay groups, the warmup + cosine schedule.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.helpers import compose_config, run_workers

STEPS, GLOBAL, MICRO, LR, WD, CLIP, EPS = 4, 16, 4, 3e-3, 0.1, 0.5, 1e-5
COMMON = [
    "data=synthetic",
    "data.synthetic_train_size=48",
    "data.synthetic_val_size=8",
    "data.num_classes=10",
    "data.num_workers=0",
    "model.backend=torch",
    "precision=fp32",
    "model.hidden_size=32",
    "model.depth=2",
    "model.num_heads=2",
    f"training.steps={STEPS}",
    f"training.global_batch_size={GLOBAL}",
    f"training.micro_batch_size={MICRO}",
    "training.log_every_n_steps=1",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    f"optim.lr={LR}",
    f"optim.weight_decay={WD}",
    f"optim.max_grad_norm={CLIP}",
    f"optim.eps={EPS}",
    "scheduler.warmup_steps=2",
    "logger.progress_bar=never",
    "checkpoint.save_final=false",
]


def _train_worker(overrides: list[str], run_dir: str, shim: bool, graphed_step: bool = False) -> dict:
    if shim:
        from tests.support.mfsdp_cpu_shim import install

        install()
    if graphed_step:  # the graphed micro-batch step, which never gets past its eager warm-up on CPU
        from core.training import cuda_graphs

        cuda_graphs.forward_backward = lambda parallel, recipe, autocast, graphs, te_layers: (
            cuda_graphs.GraphedForwardBackward(parallel, recipe, autocast, warmup=10**9)
        )
    from tests.support.helpers import train_run

    cfg = compose_config("vit_sanity", overrides + [f"checkpoint.path={run_dir}/ckpt"])
    trained = train_run(cfg, run_dir, full_state=True)
    out = {"state": trained["state"], "param_groups": trained["param_groups"]}
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        out["losses"] = [r["loss"] for r in rows if "split" not in r]
    return out


def reference_run(device: torch.device = torch.device("cpu"), layers: str = "torch") -> dict:
    """Plain PyTorch: no process group, no wrapper, one forward per optimizer step."""
    from torch.utils.data import default_collate

    from core.data.datasets import MultiEpochDatasetResampler
    from core.data.sampling import GlobalBatchSampler
    from core.layers.namespace import get_layers
    from core.training.optim import lr_multiplier
    from recipes.vit.recipe import ViTRecipe
    from tests.support.helpers import validated_config

    cfg = validated_config("vit_sanity", COMMON + ["checkpoint.path=unused"])
    recipe = ViTRecipe(cfg)
    torch.manual_seed(0)
    model = recipe.build_model(get_layers(layers), device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n not in ("cls_token", "pos_embed")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n in ("cls_token", "pos_embed")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=EPS
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, STEPS, cfg.scheduler))
    train_set = MultiEpochDatasetResampler(recipe.build_datasets().train, num_samples=STEPS * GLOBAL, seed=cfg.seed)
    batches = iter(GlobalBatchSampler(GLOBAL, GLOBAL, 1, 0))
    losses = []
    for _ in range(STEPS):
        samples = [train_set[i] for i in next(batches)]
        batch = recipe.to_device(default_collate(samples), device)  # as the loop moves a batch
        images, labels = batch["image"], batch["label"]
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return {"state": state, "losses": losses}


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def assert_matches(result: dict, reference: dict, rtol: float = 1e-6) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], rel=rtol, abs=1e-7)
    assert result["state"].keys() == reference["state"].keys()
    for name, ref in reference["state"].items():
        got = result["state"][name]
        err = (got - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err <= rtol, f"{name}: relative difference {err:.3e}"


BACKENDS = [
    pytest.param(["distributed=fsdp2"], False, id="fsdp2"),
    pytest.param(["distributed=ddp"], False, id="ddp"),
    *[
        pytest.param(["distributed=mfsdp", f"distributed.mfsdp.zero_dp_strategy={z}"], True, id=f"mfsdp-zero{z}")
        for z in (0, 1, 2, 3)
    ],
    # No accumulation: ZeRO-0/1 reduce only when told that a micro-batch is the last one.
    pytest.param(
        ["distributed=mfsdp", "distributed.mfsdp.zero_dp_strategy=1", f"training.micro_batch_size={GLOBAL // 2}"],
        True,
        id="mfsdp-zero1-no-accumulation",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,shim", BACKENDS)
def test_two_ranks_match_single_process_reference(overrides, shim, reference, tmp_path):
    # 2 ranks x micro-batch 4 x 2 accumulation steps (or 8 x 1) = the reference's one batch of 16.
    results = run_workers(2, _train_worker, COMMON + overrides, str(tmp_path), shim)
    assert results[0]["state"].keys() == results[1]["state"].keys()
    # The weight-decay groups survive the wrapping: 10 weight matrices decay; biases, norms, cls_token and
    # pos_embed (22 tensors) do not.
    assert results[0]["param_groups"] == [("decay", 10, WD), ("no_decay", 22, 0.0)]
    assert_matches(results[0], reference)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1])
def test_gradients_reduced_after_the_last_micro_batch_match_the_reference(zero, reference, tmp_path):
    """How a graphed step reduces on several ranks (core/training/cuda_graphs.py): every micro-batch runs as one
    that does not reduce, then Parallel.reduce_gradients after the step's last. Here on Megatron-FSDP (CPU shim),
    2 ranks x 2 accumulated micro-batches, eagerly (the graphs themselves: tests/gpu/test_cuda_graphs.py)."""
    overrides = ["distributed=mfsdp", f"distributed.mfsdp.zero_dp_strategy={zero}"]
    results = run_workers(2, _train_worker, COMMON + overrides, str(tmp_path), True, True)
    assert_matches(results[0], reference)


@pytest.mark.parametrize(
    "overrides,shim",
    [(["distributed=fsdp2"], False), (["distributed=mfsdp", "distributed.mfsdp.zero_dp_strategy=3"], True)],
    ids=["fsdp2", "mfsdp-one-rank-runs-zero0"],
)
@pytest.mark.slow
def test_single_process_loop_matches_reference(overrides, shim, reference, tmp_path):
    # 1 rank x micro-batch 4 x 4 accumulation steps.
    (result,) = run_workers(1, _train_worker, COMMON + overrides, str(tmp_path), shim)
    assert_matches(result, reference)


def _save_worker(overrides: list[str], run_dir: str, shim: bool) -> list[str]:
    _train_worker(overrides, run_dir, shim)
    import torch.distributed.checkpoint as dcp

    return sorted(dcp.FileSystemReader(f"{run_dir}/ckpt/step_{1}").read_metadata().state_dict_metadata)


@pytest.mark.parametrize(
    "overrides,shim",
    [(["distributed=fsdp2"], False), (["distributed=ddp"], False), (["distributed=mfsdp"], True)],
    ids=["fsdp2", "ddp", "mfsdp"],
)
@pytest.mark.slow
def test_final_checkpoint_uses_canonical_names(overrides, shim, tmp_path):
    """Every backend writes the same key layout: model.<name>, optim.state.<name>.<state>."""
    keys = run_workers(
        2, _save_worker, COMMON + overrides + ["training.steps=1", "checkpoint.save_final=true"], str(tmp_path), shim
    )[0]
    assert "model.patch_embed.proj.weight" in keys and "model.blocks.1.layernorm_mlp.fc2_bias" in keys
    assert "optim.state.patch_embed.proj.weight.exp_avg" in keys
    assert "optim.state.blocks.0.self_attention.layernorm_qkv.weight.exp_avg_sq" in keys
    assert not any(".module." in k or k.startswith("model.module.") for k in keys)
    assert (tmp_path / "ckpt" / "step_1" / "COMPLETE").exists()
