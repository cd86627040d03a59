"""Q/K/V split of a packed grouped-query projection with rotary positions (rotate-half), one Triton kernel
each way: what TE's `apply_fused_qkv_rotary_pos_emb` computes, in the same layouts and with the same
float operations in the same order, so the results are TE's bit for bit (GPU test).

TE's kernels give each token its own thread block and move one 2-byte element per thread and load; these
move a few tokens' head-wide rows per program and compute each token's cos and sin once, which takes about
half the time (docs/performance.md). Whatever they do not cover (interleaved or partial rotary dimensions, a head size
that is not a power of two, start positions, context parallelism) goes to TE's function.

Layouts (sbhd, or bshd with batch and sequence swapped):
  qkv     [s, b, groups, (heads_per_group + 2) * head_dim]  per group: its query heads, then K, then V
  query   [s, b, groups * heads_per_group, head_dim]          contiguous
  key     [s, b, groups, head_dim]                            contiguous
  value   [s, b, groups, head_dim]                            contiguous
  freqs   [s2 >= s, 1, 1, head_dim] float32 angles, one pair of halves per position
"""

from __future__ import annotations

import functools

import torch


# Tokens per program and warps per program (benchmarks/qkv_rope.py --sweep compares others).
BLOCK_ROWS, NUM_WARPS = 4, 2


def _launch(kernel, n_rows: int, *args, **constants):
    kernel[((n_rows + BLOCK_ROWS - 1) // BLOCK_ROWS,)](*args, **constants, BLOCK_ROWS=BLOCK_ROWS, num_warps=NUM_WARPS)


class _SplitRotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_freqs, k_freqs, per_group: int, seq_major: bool):
        rows = qkv.shape[0] * qkv.shape[1]
        groups, head_dim = qkv.shape[2], qkv.shape[3] // (per_group + 2)
        seq_len, batch = (qkv.shape[0], qkv.shape[1]) if seq_major else (qkv.shape[1], qkv.shape[0])
        query = qkv.new_empty(*qkv.shape[:2], groups * per_group, head_dim)
        key, value = (qkv.new_empty(*qkv.shape[:2], groups, head_dim) for _ in "kv")
        from core.layers.qkv_rope_kernels import forward

        _launch(forward, rows, qkv, q_freqs, k_freqs, query, key, value, rows, seq_len, batch,
                GROUPS=groups, PER_GROUP=per_group, HALF=head_dim // 2, SEQ_MAJOR=seq_major)
        ctx.save_for_backward(q_freqs, k_freqs)
        ctx.per_group, ctx.seq_major, ctx.qkv_shape = per_group, seq_major, qkv.shape
        return query, key, value

    @staticmethod
    def backward(ctx, grad_query, grad_key, grad_value):
        q_freqs, k_freqs = ctx.saved_tensors
        shape, per_group = ctx.qkv_shape, ctx.per_group
        rows, groups, head_dim = shape[0] * shape[1], shape[2], shape[3] // (per_group + 2)
        seq_len, batch = (shape[0], shape[1]) if ctx.seq_major else (shape[1], shape[0])
        grad_qkv = grad_query.new_empty(shape)
        from core.layers.qkv_rope_kernels import backward

        _launch(backward, rows, grad_query.contiguous(), grad_key.contiguous(), grad_value.contiguous(),
                q_freqs, k_freqs, grad_qkv, rows, seq_len, batch,
                GROUPS=groups, PER_GROUP=per_group, HALF=head_dim // 2, SEQ_MAJOR=ctx.seq_major)
        return grad_qkv, None, None, None, None


def _angles(freqs: torch.Tensor) -> torch.Tensor:
    return freqs.float().contiguous()


def kernel_applies(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, per_group: int,
                   head_dim: int, tensor_format: str, interleaved: bool) -> bool:
    """Whether `split_rotate` runs its own kernels for these arguments (TE's function otherwise)."""
    seq_len = qkv.shape[0] if tensor_format == "sbhd" else qkv.shape[1]
    return (qkv.is_cuda and qkv.dim() == 4 and qkv.is_contiguous() and tensor_format in ("sbhd", "bshd")
            and not interleaved and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and qkv.shape[3] == (per_group + 2) * head_dim and head_dim >= 4 and head_dim & (head_dim - 1) == 0
            and all(f.dim() == 4 and f.shape[1:] == (1, 1, head_dim) and f.shape[0] >= seq_len and f.is_cuda
                    for f in (q_freqs, k_freqs))
            and _triton_available())


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        from triton.language.extra import libdevice  # noqa: F401
    except ImportError:
        return False
    return True


def split_rotate(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, per_group: int,
                 head_dim: int, tensor_format: str = "sbhd", interleaved: bool = False):
    """(query, key, value) of a packed projection output `qkv` [.., groups, (per_group + 2) * head_dim],
    with rotary positions applied to query and key: TE's `apply_fused_qkv_rotary_pos_emb`."""
    if kernel_applies(qkv, q_freqs, k_freqs, per_group, head_dim, tensor_format, interleaved):
        return _SplitRotate.apply(qkv, _angles(q_freqs), _angles(k_freqs), per_group, tensor_format == "sbhd")
    from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb

    return apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [per_group * head_dim, head_dim, head_dim],
                                          tensor_format=tensor_format, interleaved=interleaved)
