"""The Q/K/V split with rotary positions of the GPT blocks: TE's fused kernels against ours (core/layers/qkv_rope.py).

    python benchmarks/qkv_rope.py                        # gpt_1b's shape: 16 x 2048 tokens, 8 groups of 2 heads of 128
    python benchmarks/qkv_rope.py --batch 8 --seq 1024 --groups 12 --heads-per-group 1 --head-dim 64   # gpt_125m's

Per implementation and direction: milliseconds per call (CUDA events around back-to-back calls, median of
rounds, after warm-up), the bytes it must read and write and the bandwidth that makes, and the step's share
(x layers). Then whether the two agree bit for bit (outputs and the packed gradient).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.layers import qkv_rope  # noqa: E402


def time_ms(fn, rounds: int = 7, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--heads-per-group", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--format", choices=("bshd", "sbhd"), default="bshd")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time our kernels at other tokens and warps per program than qkv_rope.BLOCK_ROWS and NUM_WARPS",
    )
    args = parser.parse_args()

    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb

    per_group, head_dim = args.heads_per_group, args.head_dim
    outer = (args.batch, args.seq) if args.format == "bshd" else (args.seq, args.batch)
    qkv = torch.randn(*outer, args.groups, (per_group + 2) * head_dim, device="cuda", dtype=torch.bfloat16)
    freqs = te.RotaryPositionEmbedding(head_dim)(args.seq).cuda()
    assert qkv_rope.kernel_applies(qkv, freqs, freqs, per_group, head_dim, args.format, False)
    implementations = {
        "TE apply_fused_qkv_rotary_pos_emb": lambda x: apply_fused_qkv_rotary_pos_emb(
            x, freqs, freqs, [per_group * head_dim, head_dim, head_dim], tensor_format=args.format
        ),
        "ours (qkv_rope.split_rotate)": lambda x: qkv_rope.split_rotate(
            x, freqs, freqs, per_group, head_dim, args.format
        ),
    }
    moved = 2 * qkv.numel() * qkv.element_size()  # each element read once and written once, each way
    print(f"qkv {tuple(qkv.shape)} {args.format} bf16: {moved / 1e6:.0f} MB moved per call, {args.layers} layers")
    copy_ms = time_ms(lambda: qkv.clone())
    print(f"{'torch copy of qkv (the bandwidth bound)':45s} {copy_ms:7.3f} ms  {moved / copy_ms / 1e9:6.2f} TB/s")
    results = {}
    for name, split in implementations.items():
        x = qkv.clone().requires_grad_()
        outputs = split(x)
        grads = [torch.randn_like(o) for o in outputs] if not results else results["grads"]
        forward_ms = time_ms(lambda: split(qkv))
        backward_ms = time_ms(lambda: torch.autograd.grad(outputs, x, grads, retain_graph=True))
        results.setdefault("grads", grads)
        results[name] = [o.detach() for o in outputs] + list(torch.autograd.grad(outputs, x, grads))
        for direction, ms in (("forward", forward_ms), ("backward", backward_ms)):
            print(
                f"{name:36s} {direction:8s} {ms:7.3f} ms  {moved / ms / 1e9:6.2f} TB/s  "
                f"x{args.layers} layers: {ms * args.layers:6.2f} ms"
            )
    if args.sweep:
        chosen = qkv_rope.BLOCK_ROWS, qkv_rope.NUM_WARPS
        x = qkv.clone().requires_grad_()
        for qkv_rope.BLOCK_ROWS in (4, 8, 16, 32):
            for qkv_rope.NUM_WARPS in (2, 4, 8):
                outputs = qkv_rope.split_rotate(x, freqs, freqs, per_group, head_dim, args.format)
                forward_ms = time_ms(lambda: qkv_rope.split_rotate(qkv, freqs, freqs, per_group, head_dim, args.format))
                backward_ms = time_ms(lambda: torch.autograd.grad(outputs, x, results["grads"], retain_graph=True))
                print(
                    f"ours, {qkv_rope.BLOCK_ROWS:2d} tokens and {qkv_rope.NUM_WARPS} warps per program: "
                    f"forward {forward_ms:.3f} ms ({moved / forward_ms / 1e9:.2f} TB/s), "
                    f"backward {backward_ms:.3f} ms ({moved / backward_ms / 1e9:.2f} TB/s)"
                )
        qkv_rope.BLOCK_ROWS, qkv_rope.NUM_WARPS = chosen
    ours, theirs = (results[name] for name in implementations)
    for label, a, b in zip(("query", "key", "value", "qkv gradient"), ours, theirs):
        differing = int((a != b).sum())
        print(
            f"{label:13s} {'bitwise equal' if differing == 0 else f'{differing} of {a.numel()} elements differ'}"
            f" (largest difference {float((a.float() - b.float()).abs().max()):.3g})"
        )


if __name__ == "__main__":
    main()
