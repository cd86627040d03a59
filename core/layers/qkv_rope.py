"""Q/K/V split of a packed grouped-query projection with rotary positions (rotate-half), one Triton kernel
each way: what TE's `apply_fused_qkv_rotary_pos_emb` computes, in the same layouts and with the same
float operations in the same order, so the results are TE's bit for bit (GPU test).

TE's kernels give each token its own thread block and move one 2-byte element per thread and load; these
move a few tokens' head-wide rows per program and compute each token's cos and sin once, which is faster
(docs/performance.md). Whatever they do not cover (interleaved or partial rotary dimensions, a head size
that is not a power of two, start positions, context parallelism) goes to TE's functions.

Layouts (sbhd, or bshd with batch and sequence swapped; thd without the batch dimension: packed sequences,
each token's position its index in its own sequence, found from cu_seqlens by a binary search per token):
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


LAYOUTS = {"sbhd": 0, "bshd": 1, "thd": 2}  # the kernels' LAYOUT


def _rows(shape: torch.Size, layout: str) -> tuple[int, int, int]:
    """(token rows, sequence length, batch) of a packed projection output's shape; thd: (tokens, 0, 0)."""
    if layout == "thd":
        return shape[0], 0, 0
    seq_len, batch = (shape[0], shape[1]) if layout == "sbhd" else (shape[1], shape[0])
    return shape[0] * shape[1], seq_len, batch


def _launch(backward: bool, qkv, query, key, value, q_freqs, k_freqs, per_group: int, layout: str, cu_seqlens):
    """The kernel one way: qkv split into query, key and value, or (backward, each the gradient) joined back.
    Outside thd the kernel takes no cu_seqlens (None: a compile-time constant, never read), so a launch
    allocates nothing besides its outputs (CUDA graphs capture it as it is)."""
    from core.layers.qkv_rope_kernels import split_rotate

    rows, seq_len, batch = _rows(qkv.shape, layout)
    groups, head_dim = qkv.shape[-2], qkv.shape[-1] // (per_group + 2)
    sequences = 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    positions = min(q_freqs.shape[0], k_freqs.shape[0])
    split_rotate[((rows + BLOCK_ROWS - 1) // BLOCK_ROWS,)](
        qkv,
        query,
        key,
        value,
        q_freqs,
        k_freqs,
        rows,
        seq_len,
        batch,
        cu_seqlens,
        sequences,
        positions,
        BACKWARD=backward,
        GROUPS=groups,
        PER_GROUP=per_group,
        HALF=head_dim // 2,
        LAYOUT=LAYOUTS[layout],
        SEARCH_STEPS=_search_steps(cu_seqlens),
        BLOCK_ROWS=BLOCK_ROWS,
        num_warps=NUM_WARPS,
    )


class _SplitRotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_freqs, k_freqs, per_group: int, layout: str, cu_seqlens):
        groups, head_dim = qkv.shape[-2], qkv.shape[-1] // (per_group + 2)
        query = qkv.new_empty(*qkv.shape[:-2], groups * per_group, head_dim)
        key, value = (qkv.new_empty(*qkv.shape[:-2], groups, head_dim) for _ in "kv")
        _launch(False, qkv, query, key, value, q_freqs, k_freqs, per_group, layout, cu_seqlens)
        ctx.save_for_backward(q_freqs, k_freqs, cu_seqlens)
        ctx.per_group, ctx.layout, ctx.qkv_shape = per_group, layout, qkv.shape
        return query, key, value

    @staticmethod
    def backward(ctx, grad_query, grad_key, grad_value):
        q_freqs, k_freqs, cu_seqlens = ctx.saved_tensors
        grad_qkv = grad_query.new_empty(ctx.qkv_shape)
        _launch(
            True,
            grad_qkv,
            grad_query.contiguous(),
            grad_key.contiguous(),
            grad_value.contiguous(),
            q_freqs,
            k_freqs,
            ctx.per_group,
            ctx.layout,
            cu_seqlens,
        )
        return grad_qkv, None, None, None, None, None


def _search_steps(cu_seqlens) -> int:
    return 0 if cu_seqlens is None else max(1, (cu_seqlens.shape[0] - 1).bit_length())


def _angles(freqs: torch.Tensor) -> torch.Tensor:
    return freqs.float().contiguous()


def kernel_applies(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    per_group: int,
    head_dim: int,
    tensor_format: str,
    interleaved: bool,
    cu_seqlens: torch.Tensor | None = None,
) -> bool:
    """Whether `split_rotate` runs its own kernels for these arguments (TE's function otherwise)."""
    if tensor_format == "thd":
        shape_ok = (
            qkv.dim() == 3
            and cu_seqlens is not None
            and cu_seqlens.dim() == 1
            and cu_seqlens.shape[0] >= 2
            and cu_seqlens.dtype == torch.int32
            and cu_seqlens.is_contiguous()
            and cu_seqlens.is_cuda
        )
    else:
        seq_len = qkv.shape[0] if tensor_format == "sbhd" else qkv.shape[1]
        shape_ok = (
            tensor_format in ("sbhd", "bshd")
            and qkv.dim() == 4
            and cu_seqlens is None
            and all(f.shape[0] >= seq_len for f in (q_freqs, k_freqs))
        )
    return (
        shape_ok
        and qkv.is_cuda
        and qkv.is_contiguous()
        and not interleaved
        and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and qkv.shape[-1] == (per_group + 2) * head_dim
        and head_dim >= 4
        and head_dim & (head_dim - 1) == 0
        and all(f.dim() == 4 and f.shape[1:] == (1, 1, head_dim) and f.is_cuda for f in (q_freqs, k_freqs))
        and _triton_available()
    )


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        from triton.language.extra import libdevice  # noqa: F401
    except ImportError:
        return False
    return True


def split_rotate(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    per_group: int,
    head_dim: int,
    tensor_format: str = "sbhd",
    interleaved: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """(query, key, value) of a packed projection output `qkv` [.., groups, (per_group + 2) * head_dim],
    with rotary positions applied to query and key: TE's `apply_fused_qkv_rotary_pos_emb` (sbhd, bshd), or
    for packed sequences (thd, `cu_seqlens` [sequences + 1] int32) TE's split and `apply_rotary_pos_emb` of Q
    and of K, positions restarting at each sequence (the caller keeps every sequence within the angles, as
    TE's kernels need too)."""
    if kernel_applies(qkv, q_freqs, k_freqs, per_group, head_dim, tensor_format, interleaved, cu_seqlens):
        return _SplitRotate.apply(qkv, _angles(q_freqs), _angles(k_freqs), per_group, tensor_format, cu_seqlens)
    from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb

    if tensor_format != "thd":
        return apply_fused_qkv_rotary_pos_emb(
            qkv,
            q_freqs,
            k_freqs,
            [per_group * head_dim, head_dim, head_dim],
            tensor_format=tensor_format,
            interleaved=interleaved,
        )
    groups = qkv.shape[-2]
    query, key, value = qkv.split([per_group * head_dim, head_dim, head_dim], dim=-1)
    query = query.reshape(qkv.shape[0], groups * per_group, head_dim)
    rotate = functools.partial(
        apply_rotary_pos_emb, tensor_format="thd", fused=True, cu_seqlens=cu_seqlens, interleaved=interleaved
    )
    return rotate(query, q_freqs), rotate(key, k_freqs), value
