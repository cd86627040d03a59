"""The QKV-RoPE Triton kernels (core/layers/qkv_rope_kernels.py) on a CPU, through Triton's interpreter:
forward and backward against a float64 rotate-half reference, in sbhd, bshd and thd (packed sequences with an
empty one, rows past the last offset, positions past the angles). The GPU tests hold them to TE bit for bit;
this catches a wrong index, offset or rotation direction where no GPU is. The interpreter has no libdevice:
numpy's cos and sin stand in for it, so the comparison is to a tolerance."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]

# (layout, leading dimensions, groups, query heads per group, head size, dtype)
CASES = [
    ("sbhd", (5, 3), 2, 2, 8, torch.float32),
    ("bshd", (2, 7), 3, 1, 16, torch.float32),
    ("sbhd", (6, 2), 2, 3, 4, torch.bfloat16),
    ("thd", (23,), 2, 2, 8, torch.float32),
    ("thd", (22,), 1, 3, 4, torch.float16),
]
CU_SEQLENS = [0, 5, 5, 9, 17, 20]  # thd: an empty sequence; rows 20.. lie past the last one


def _positions(rows_or_seq: int, layout: str, n_positions: int) -> torch.Tensor:
    if layout != "thd":
        return torch.arange(rows_or_seq)
    cu = CU_SEQLENS
    positions = torch.cat(
        [torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])] + [torch.zeros(rows_or_seq - cu[-1], dtype=torch.long)]
    )  # past the end: position 0
    return torch.where(positions < n_positions, positions, 0)


def reference(qkv, q_freqs, k_freqs, per_group: int, layout: str):
    """(query, key, value) in float64: split, then x * cos + rotate_half(x) * sin at each row's position."""
    head_dim = qkv.shape[-1] // (per_group + 2)
    seq = qkv.shape[1] if layout == "bshd" else qkv.shape[0]
    positions = _positions(seq, layout, min(q_freqs.shape[0], k_freqs.shape[0]))
    query, key, value = qkv.double().split([per_group * head_dim, head_dim, head_dim], -1)
    query = query.reshape(*query.shape[:-2], -1, head_dim)
    shape = {"sbhd": (-1, 1, 1, head_dim), "bshd": (1, -1, 1, head_dim), "thd": (-1, 1, head_dim)}[layout]

    def rotate(x, freqs):
        angles = freqs[positions, 0, 0].double().reshape(shape)
        half = torch.cat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], -1)
        return x * angles.cos() + half * angles.sin()

    return rotate(query, q_freqs), rotate(key, k_freqs), value


def check_all_cases() -> None:
    """Run in a process with TRITON_INTERPRET=1 (read when the kernels are defined)."""
    import triton.language as tl

    from core.layers import qkv_rope, qkv_rope_kernels

    qkv_rope_kernels.libdevice = types.SimpleNamespace(cos=lambda x: tl.cos(x), sin=lambda x: tl.sin(x))
    torch.manual_seed(0)
    for layout, outer, groups, per_group, head_dim, dtype in CASES:
        qkv = (torch.randn(*outer, groups, (per_group + 2) * head_dim) * 4).to(dtype)
        seq = outer[1] if layout == "bshd" else outer[0]
        q_freqs, k_freqs = (torch.randn(seq + 3, 1, 1, head_dim) * 3 for _ in "qk")
        cu_seqlens = None
        if layout == "thd":
            cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
            q_freqs, k_freqs = q_freqs[:6], k_freqs[:7]  # sequence 3 runs past both: position 0 there
        x = qkv.clone().requires_grad_()
        outputs = qkv_rope._SplitRotate.apply(x, q_freqs, k_freqs, per_group, layout, cu_seqlens)
        grads = [torch.randn_like(o) for o in outputs]
        torch.autograd.backward(outputs, grads)
        x64 = qkv.double().requires_grad_()
        expected = reference(x64, q_freqs, k_freqs, per_group, layout)
        torch.autograd.backward(expected, [g.double() for g in grads])
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for name, ours, theirs in zip(
            ("query", "key", "value", "qkv gradient"), [*outputs, x.grad], [*expected, x64.grad]
        ):
            assert ours.shape == theirs.shape and ours.dtype == dtype, (layout, name)
            error = (ours.double() - theirs).abs().max().item() / max(1.0, theirs.abs().max().item())
            assert error < tolerance, (layout, outer, name, error)
    print("checked", len(CASES), "cases")


@pytest.mark.slow
def test_qkv_rope_kernels_interpreted_on_cpu_match_a_float64_reference():
    pytest.importorskip("triton.language.extra.libdevice")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"checked {len(CASES)} cases" in proc.stdout


if __name__ == "__main__":
    check_all_cases()
