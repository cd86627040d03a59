"""The Triton kernels of `qkv_rope.py` (imported only where Triton is: CUDA builds of torch bring it).
Triton resolves the functions a kernel calls by their module-level names, so they live here.

A program takes BLOCK_ROWS tokens whole: it computes their rotation angles' cos and sin once (for Q and
for K) and walks the token rows' head-wide slices, group by group."""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rows_and_positions(n_rows, seq_len, batch, cu_seqlens, n_seqs, n_positions, LAYOUT: tl.constexpr,
                       SEARCH_STEPS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """This program's token rows, each row's position (its index in its own sequence) and the rows' mask."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = rows < n_rows
    if LAYOUT == 0:  # sbhd: rows run (s, b)
        positions = rows // batch
    elif LAYOUT == 1:  # bshd: rows run (b, s)
        positions = rows % seq_len
    else:  # thd: packed sequences; row r lies in the last sequence b with cu_seqlens[b] <= r
        low = tl.zeros_like(rows)
        high = tl.zeros_like(rows) + n_seqs
        for _ in tl.static_range(SEARCH_STEPS):  # binary search, 2**SEARCH_STEPS > n_seqs
            middle = (low + high + 1) // 2
            up = tl.load(cu_seqlens + middle, mask=in_range, other=0) <= rows
            low = tl.where(up, middle, low)
            high = tl.where(up, high, middle - 1)
        positions = rows - tl.load(cu_seqlens + low, mask=in_range, other=0)
        # Rows past the last offset (TE leaves them unwritten) and positions past the angles: unrotated.
        end = tl.load(cu_seqlens + n_seqs)
        positions = tl.where((rows < end) & (positions < n_positions), positions, 0)
    return rows.to(tl.int64), positions, in_range[:, None]


@triton.jit
def cos_sin(freqs, positions, cols, mask, HALF: tl.constexpr):
    # cos and sin of both halves' angles at each row's position (libdevice: the precise functions CUDA's
    # sincosf computes, not the approximate ones tl.cos and tl.sin lower to).
    at = freqs + positions[:, None] * (2 * HALF) + cols
    angle1 = tl.load(at, mask=mask)
    angle2 = tl.load(at + HALF, mask=mask)
    return libdevice.cos(angle1), libdevice.sin(angle1), libdevice.cos(angle2), libdevice.sin(angle2)


@triton.jit
def rotate(source, target, cos1, sin1, cos2, sin2, mask, HALF: tl.constexpr):
    # target = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), with the first product in the
    # multiply-add as TE's compiled kernel has it (the other order differs from TE in a few elements)
    x1 = tl.load(source, mask=mask)
    x2 = tl.load(source + HALF, mask=mask)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(target, tl.fma(a1, cos1, -a2 * sin1).to(x1.dtype), mask=mask)
    tl.store(target + HALF, tl.fma(a2, cos2, a1 * sin2).to(x1.dtype), mask=mask)


@triton.jit
def rotate_back(source, target, cos1, sin1, cos2, sin2, mask, HALF: tl.constexpr):
    # the transpose of `rotate`: (g1 cos1 + g2 sin2, g2 cos2 - g1 sin1)
    g1 = tl.load(source, mask=mask)
    g2 = tl.load(source + HALF, mask=mask)
    b1, b2 = g1.to(tl.float32), g2.to(tl.float32)
    tl.store(target, tl.fma(b1, cos1, b2 * sin2).to(g1.dtype), mask=mask)
    tl.store(target + HALF, tl.fma(b2, cos2, b1 * -sin1).to(g1.dtype), mask=mask)


@triton.jit
def copy(source, target, mask, HALF: tl.constexpr):
    tl.store(target, tl.load(source, mask=mask), mask=mask)
    tl.store(target + HALF, tl.load(source + HALF, mask=mask), mask=mask)


@triton.jit
def forward(qkv, q_freqs, k_freqs, query, key, value, n_rows, seq_len, batch,
            cu_seqlens, n_seqs, n_positions,
            GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, HALF: tl.constexpr,
            LAYOUT: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows, positions, mask = rows_and_positions(n_rows, seq_len, batch, cu_seqlens, n_seqs, n_positions, LAYOUT,
                                               SEARCH_STEPS, BLOCK_ROWS)
    cols = tl.arange(0, HALF)[None, :]
    q_cos1, q_sin1, q_cos2, q_sin2 = cos_sin(q_freqs, positions, cols, mask, HALF)
    k_cos1, k_sin1, k_cos2, k_sin2 = cos_sin(k_freqs, positions, cols, mask, HALF)
    packed_rows = qkv + rows[:, None] * (GROUPS * (PER_GROUP + 2) * 2 * HALF) + cols
    query_rows = query + rows[:, None] * (GROUPS * PER_GROUP * 2 * HALF) + cols
    key_rows = key + rows[:, None] * (GROUPS * 2 * HALF) + cols
    value_rows = value + rows[:, None] * (GROUPS * 2 * HALF) + cols
    for group in range(GROUPS):
        for part in tl.static_range(PER_GROUP + 2):  # the group's query heads, then K, then V
            source = packed_rows + (group * (PER_GROUP + 2) + part) * (2 * HALF)
            if part == PER_GROUP + 1:
                copy(source, value_rows + group * (2 * HALF), mask, HALF)
            elif part == PER_GROUP:
                rotate(source, key_rows + group * (2 * HALF), k_cos1, k_sin1, k_cos2, k_sin2, mask, HALF)
            else:
                rotate(source, query_rows + (group * PER_GROUP + part) * (2 * HALF),
                       q_cos1, q_sin1, q_cos2, q_sin2, mask, HALF)


@triton.jit
def backward(grad_query, grad_key, grad_value, q_freqs, k_freqs, grad_qkv, n_rows, seq_len, batch,
            cu_seqlens, n_seqs, n_positions,
             GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, HALF: tl.constexpr,
             LAYOUT: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows, positions, mask = rows_and_positions(n_rows, seq_len, batch, cu_seqlens, n_seqs, n_positions, LAYOUT,
                                               SEARCH_STEPS, BLOCK_ROWS)
    cols = tl.arange(0, HALF)[None, :]
    q_cos1, q_sin1, q_cos2, q_sin2 = cos_sin(q_freqs, positions, cols, mask, HALF)
    k_cos1, k_sin1, k_cos2, k_sin2 = cos_sin(k_freqs, positions, cols, mask, HALF)
    packed_rows = grad_qkv + rows[:, None] * (GROUPS * (PER_GROUP + 2) * 2 * HALF) + cols
    query_rows = grad_query + rows[:, None] * (GROUPS * PER_GROUP * 2 * HALF) + cols
    key_rows = grad_key + rows[:, None] * (GROUPS * 2 * HALF) + cols
    value_rows = grad_value + rows[:, None] * (GROUPS * 2 * HALF) + cols
    for group in range(GROUPS):
        for part in tl.static_range(PER_GROUP + 2):
            target = packed_rows + (group * (PER_GROUP + 2) + part) * (2 * HALF)
            if part == PER_GROUP + 1:
                copy(value_rows + group * (2 * HALF), target, mask, HALF)
            elif part == PER_GROUP:
                rotate_back(key_rows + group * (2 * HALF), target, k_cos1, k_sin1, k_cos2, k_sin2, mask, HALF)
            else:
                rotate_back(query_rows + (group * PER_GROUP + part) * (2 * HALF), target,
                            q_cos1, q_sin1, q_cos2, q_sin2, mask, HALF)
