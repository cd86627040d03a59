"""TE TransformerLayer variants, bare: 12 ViT-B/16 layers (bf16 weights, fused AdamW) on one GPU.

    python benchmarks/te_layers.py --micro-batch 256

Compares te.TransformerLayer as TE builds it with the recipes' version (core/layers/te_transformer_layer.py)
and each of its two changes alone: step time, GPU busy time (torch.profiler) and the top kernels; then
checks that the packed-QKV change alone leaves outputs and gradients bitwise equal, and how far the
GEMM-epilogue GELU moves them (bf16 rounding). No Megatron-FSDP, data or embedding: the layers only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(cls, triton_gelu: bool):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        *[
            cls(
                hidden_size=768,
                ffn_hidden_size=3072,
                num_attention_heads=12,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="no_mask",
                attn_input_format="bshd",
                fuse_qkv_params=True,
                params_dtype=torch.bfloat16,
                layer_number=i + 1,
                device="cuda",
            )
            for i in range(12)
        ]
    )
    for layer in layers:  # TE's switch between its Triton bias+GELU kernels and the GEMM epilogue
        layer.layernorm_mlp.bias_gelu_nvfusion = triton_gelu
    return layers


def measure(name: str, cls, triton_gelu: bool, micro_batch: int, steps: int):
    model = build(cls, triton_gelu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(micro_batch, 197, 768, device="cuda", dtype=torch.bfloat16)

    def step():
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / 3e3 for e in prof.key_averages() if e.device_type.name == "CUDA"}
    print(
        f"{name}: {ms:.1f} ms/step ({micro_batch / ms * 1e3:.0f} img/s), GPU busy {sum(kernels.values()):.1f} ms",
        flush=True,
    )
    for kernel, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {t:6.2f} ms  {kernel[:110]}")
    # One step from fresh weights, for the equality checks.
    model = build(cls, triton_gelu)
    out = model(x)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.detach().clone() for p in model.parameters()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    import transformer_engine.pytorch as te

    from core.layers.te_transformer_layer import te_transformer_layer_class

    tuned = te_transformer_layer_class()
    run = lambda name, cls, triton: measure(name, cls, triton, args.micro_batch, args.steps)  # noqa: E731
    stock = run("te.TransformerLayer (TE's defaults)", te.TransformerLayer, True)
    packed = run("+ copy-free packed-QKV gradient", tuned, True)
    both = run("+ bias/GELU in the GEMM epilogues (the recipes' layer)", tuned, False)
    run("te.TransformerLayer + GEMM-epilogue GELU only", te.TransformerLayer, False)
    same = torch.equal(stock[0], packed[0]) and all(torch.equal(a, b) for a, b in zip(stock[1], packed[1]))
    print("packed-QKV change vs TE's defaults, bitwise equal:", same)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    print(
        f"recipes' layer vs TE's defaults: output rel diff {rel(both[0], stock[0]):.2e}, "
        f"largest gradient rel diff {max(rel(a, b) for a, b in zip(both[1], stock[1])):.2e}"
    )


if __name__ == "__main__":
    main()
