"""Self-attention forward + backward at the recipes' shapes, through each backend that can run it.

    python benchmarks/attention_backends.py                 # ViT-B/16 (seq 197) and gpt_1b (seq 2048, GQA) shapes
    python benchmarks/attention_backends.py --shapes vit --batch-vit 512

Backends: TransformerEngine's DotProductAttention (what the recipes' TE blocks run: cuDNN's fused
attention on Hopper) and torch's scaled_dot_product_attention with each of its kernels pinned (flash,
cuDNN, memory-efficient). Per backend: milliseconds of one layer's forward + backward (CUDA events
around rounds of back-to-back calls, median over rounds, after warm-up), the model step's share
(x layers), TFLOP/s counting the work actually done (causal attention does half the score FLOPs), and
the output's and input gradients' distance from an fp32 reference, so that all rows compute the same
function. TE and torch's cuDNN kernels each run in a process of their own: TE loads its own cuDNN, which
torch then refuses (another version in the GPU image).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# name -> (heads, key/value heads, head dim, sequence, causal, layers)
SHAPES = {"vit": (12, 12, 64, 197, False, 12), "gpt_1b": (16, 8, 128, 2048, True, 16)}


def flops(batch: int, heads: int, head_dim: int, seq: int, causal: bool) -> float:
    """Forward + backward matmul FLOPs (2 GEMMs forward, 5 backward, as flash attention does them)."""
    forward = 4.0 * batch * heads * seq * seq * head_dim
    return (forward * 3.5) / (2 if causal else 1)


def sdpa(backend: SDPBackend):
    def run(q, k, v, causal):  # q/k/v [b, s, h, d] -> [b, s, h, d]
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=causal,
                enable_gqa=k.shape[2] != q.shape[2],
            )
        return out.transpose(1, 2)

    return run


def te_attention(heads: int, kv_heads: int, head_dim: int, causal: bool):
    import transformer_engine.pytorch as te

    attention = te.DotProductAttention(
        heads,
        head_dim,
        num_gqa_groups=kv_heads,
        attention_dropout=0.0,
        qkv_format="bshd",
        attn_mask_type="causal" if causal else "no_mask",
    )

    def run(q, k, v, _causal):
        return attention(q, k, v).view(q.shape)

    return run


def reference(q, k, v, causal):
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = sdpa(SDPBackend.MATH)(q, k, v, causal)
    return out, q, k, v


def time_ms(fn, repeats: int, per_round: int = 10) -> float:
    """Median milliseconds per call over `repeats` rounds of `per_round` back-to-back calls: the host queues
    each round ahead of the GPU, so launch latency stays out of the figure, as it does in a training step."""
    times = []
    for i in range(repeats + 1):  # the first round warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_round):
            fn()
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) / per_round)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch-vit", type=int, default=256)
    p.add_argument("--batch-gpt_1b", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10, help="timed rounds of 10 calls")
    p.add_argument("--only", choices=["te", "sdpa"], help=argparse.SUPPRESS)  # the child processes
    args = p.parse_args()
    if args.only is None:
        groups = ["te", "sdpa"] if importlib.util.find_spec("transformer_engine") else ["sdpa"]
        for group in groups:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", group], check=True)
        return
    if args.only == "te":
        importlib.import_module("transformer_engine.pytorch")
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in args.shapes:
        heads, kv_heads, head_dim, seq, causal, layers = SHAPES[shape]
        batch = getattr(args, f"batch_{shape}")
        gen = torch.Generator("cuda").manual_seed(0)
        q, k, v = (
            torch.randn(batch, seq, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for n in (heads, kv_heads, kv_heads)
        )
        grad = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref_out, *ref_inputs = reference(q[:2], k[:2], v[:2], causal)  # two sequences are enough to compare
        ref_out.backward(grad[:2].float())
        work = flops(batch, heads, head_dim, seq, causal)
        print(
            f"\n{shape}: batch {batch}, seq {seq}, {heads} heads ({kv_heads} key/value), head dim {head_dim}, "
            f"{'causal' if causal else 'no mask'}; x{layers} layers per model step"
        )
        print(f"{'backend':<26}{'ms/layer':>10}{'ms/step':>10}{'TFLOP/s':>10}{'out err':>10}{'grad err':>10}")
        backends = {
            "TE DotProductAttention": lambda: te_attention(heads, kv_heads, head_dim, causal),
            "sdpa flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa efficient": lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION),
        }
        for name, make in backends.items():
            if name.startswith("TE") != (args.only == "te"):
                continue
            try:
                fn = make()
                small = [t[:2].detach().clone().requires_grad_() for t in (q, k, v)]
                out = fn(*small, causal)
                out.backward(grad[:2])
                err = rel(out, ref_out)
                grad_err = max(rel(a.grad, b.grad) for a, b in zip(small, ref_inputs))

                def step():
                    fn(q, k, v, causal).backward(grad)

                ms = time_ms(step, args.repeats)
            except Exception as e:  # a backend that does not support this shape on this device
                print(f"{name:<26}  not available: {str(e).splitlines()[0][:90]}")
                continue
            print(f"{name:<26}{ms:>10.3f}{ms * layers:>10.2f}{work / ms / 1e9:>10.0f}{err:>10.1e}{grad_err:>10.1e}")
            q.grad = k.grad = v.grad = None


if __name__ == "__main__":
    main()
