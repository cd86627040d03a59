"""GPU tests (TransformerEngine + Megatron-FSDP): run on the GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, compose_config, run_workers
from tests.test_parity import COMMON, _train_worker, assert_matches, reference_run

pytestmark = pytest.mark.gpu
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def build_vit(backend: str, overrides: list[str]):
    import train  # noqa: F401
    from core.config import validate
    from core.layers import get_layers
    from recipes.vit import ViTRecipe

    cfg = validate(compose_config("vit_base_patch16_224", ["checkpoint.path=unused", "data=synthetic", *overrides]))
    return ViTRecipe(cfg).build_model(get_layers(backend), torch.device("cuda"))


@pytest.mark.parametrize("autocast_dtype,rtol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_te_and_torch_vit_agree(autocast_dtype, rtol):
    small = ["model.depth=2", "data.num_classes=16"]
    te_model, torch_model = build_vit("te", small), build_vit("torch", small)
    te_state = {k: v for k, v in te_model.state_dict().items() if not k.endswith("_extra_state")}
    assert te_state.keys() == torch_model.state_dict().keys()  # same names, only _extra_state differs
    for k, v in torch_model.state_dict().items():  # same weights, drawn by name from the same seed
        assert torch.equal(te_state[k], v), k
    images = torch.randn(8, 3, 224, 224, device="cuda")
    outputs, grads = [], []
    for model in (te_model, torch_model):
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
            out = model(images).float()
        out.square().mean().backward()
        outputs.append(out)
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(outputs[0], outputs[1]) < rtol
    for name in grads[1]:
        assert rel(grads[0][name], grads[1][name]) < 5 * rtol, name


def train_cli(nproc: int, tmp: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(REPO / "train.py"),
           "--config-name", "vit_base_patch16_224", f"hydra.run.dir={tmp}/run", f"checkpoint.path={tmp}/ckpt",
           "logger.progress_bar=never", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


MEMORIZE = ["data=synthetic", "data.synthetic_train_size=256", "data.synthetic_val_size=64", "data.num_classes=10",
            "training.steps=40", "training.log_every_n_steps=5", "training.val_every_n_steps=0",
            "training.micro_batch_size=32", "training.global_batch_size=64", "optim.lr=3e-4", "optim.weight_decay=0",
            "scheduler.warmup_steps=5", "model.label_smoothing=0"]


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=needs_two)])
def test_mfsdp_te_vit_base_learns_synthetic(nproc, tmp_path):
    rows = train_cli(nproc, tmp_path, *MEMORIZE)
    train = [r for r in rows if "split" not in r]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"], [r["loss"] for r in train]
    assert "mfu" in train[-1] and train[-1]["mfu"] > 0
    assert (tmp_path / "ckpt" / "step_40" / "COMPLETE").exists()


@pytest.mark.parametrize("precision", ["fp8_delayed", "fp8_current"])
def test_fp8_trains(precision, tmp_path):
    rows = train_cli(1, tmp_path, *MEMORIZE, f"precision={precision}")
    losses = [r["loss"] for r in rows if "split" not in r]
    assert all(l == l for l in losses) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("layers", ["torch", "te"])
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=needs_two)])
def test_mfsdp_matches_single_gpu_reference(nproc, layers, tmp_path):
    """Megatron-FSDP on 1 or 2 GPUs vs a plain loop on one GPU with the same layers (fp32)."""
    reference = reference_run(torch.device("cuda"), layers)
    overrides = [o for o in COMMON if not o.startswith("model.backend")] + [f"model.backend={layers}", "distributed=mfsdp"]
    result = run_workers(nproc, _train_worker, overrides, str(tmp_path), False)[0]
    result["state"] = {k: v.to("cuda") for k, v in result["state"].items()}
    assert_matches(result, reference, rtol=1e-4)
