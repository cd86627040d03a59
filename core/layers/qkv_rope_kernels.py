"""The Triton kernels of `qkv_rope.py` (imported only where Triton is: CUDA builds of torch bring it).
Triton resolves the functions a kernel calls by their module-level names, so they live here.

One kernel each way (BACKWARD, a compile-time constant): the gradient moves the same slices the other way
through the transposed rotation. A program takes BLOCK_ROWS tokens whole: it computes their rotation angles'
cos and sin once (for Q and for K) and walks the token rows' head-wide slices, group by group."""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rows_and_positions(
    n_rows,
    seq_len,
    batch,
    cu_seqlens,
    n_seqs,
    n_positions,
    LAYOUT: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
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
def rotation(freqs, positions, cols, mask, HALF: tl.constexpr, BACKWARD: tl.constexpr):
    """Each row's rotation at its position, as the four factors `rotate` takes: the matrix
    [[cos1, -sin1], [sin2, cos2]] (rotate-half: target = x * cos + (-x2, x1) * sin), or its transpose
    for the gradient. cos and sin come from libdevice: the precise functions CUDA's sincosf computes, not the
    approximate ones tl.cos and tl.sin lower to."""
    at = freqs + positions[:, None] * (2 * HALF) + cols
    angle1 = tl.load(at, mask=mask)
    angle2 = tl.load(at + HALF, mask=mask)
    cos1, sin1 = libdevice.cos(angle1), libdevice.sin(angle1)
    cos2, sin2 = libdevice.cos(angle2), libdevice.sin(angle2)
    if BACKWARD:
        m12, m21 = sin2, -sin1
    else:
        m12, m21 = -sin1, sin2
    return cos1, m12, m21, cos2


@triton.jit
def rotate(source, target, m11, m12, m21, m22, mask, HALF: tl.constexpr):
    # target = [[m11, m12], [m21, m22]] (x1, x2), with each diagonal product in the multiply-add as TE's
    # compiled kernel has it (the other order differs from TE in a few elements)
    x1 = tl.load(source, mask=mask)
    x2 = tl.load(source + HALF, mask=mask)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(target, tl.fma(a1, m11, a2 * m12).to(x1.dtype), mask=mask)
    tl.store(target + HALF, tl.fma(a2, m22, a1 * m21).to(x1.dtype), mask=mask)


@triton.jit
def copy(source, target, mask, HALF: tl.constexpr):
    tl.store(target, tl.load(source, mask=mask), mask=mask)
    tl.store(target + HALF, tl.load(source + HALF, mask=mask), mask=mask)


@triton.jit
def ends(packed, separate, BACKWARD: tl.constexpr):
    """(source, target) of one head's slice: from the packed row into its own tensor, or back (BACKWARD)."""
    if BACKWARD:
        source, target = separate, packed
    else:
        source, target = packed, separate
    return source, target


@triton.jit
def split_rotate(
    qkv,
    query,
    key,
    value,
    q_freqs,
    k_freqs,
    n_rows,
    seq_len,
    batch,
    cu_seqlens,
    n_seqs,
    n_positions,
    BACKWARD: tl.constexpr,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    HALF: tl.constexpr,
    LAYOUT: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Forward: qkv's heads split into query, key and value, Q and K rotated. BACKWARD (each tensor holding
    its gradient): the gradients of query and key rotated back and, with value's, joined into qkv's."""
    rows, positions, mask = rows_and_positions(
        n_rows, seq_len, batch, cu_seqlens, n_seqs, n_positions, LAYOUT, SEARCH_STEPS, BLOCK_ROWS
    )
    cols = tl.arange(0, HALF)[None, :]
    q11, q12, q21, q22 = rotation(q_freqs, positions, cols, mask, HALF, BACKWARD)
    k11, k12, k21, k22 = rotation(k_freqs, positions, cols, mask, HALF, BACKWARD)
    packed_rows = qkv + rows[:, None] * (GROUPS * (PER_GROUP + 2) * 2 * HALF) + cols
    query_rows = query + rows[:, None] * (GROUPS * PER_GROUP * 2 * HALF) + cols
    key_rows = key + rows[:, None] * (GROUPS * 2 * HALF) + cols
    value_rows = value + rows[:, None] * (GROUPS * 2 * HALF) + cols
    for group in range(GROUPS):
        for part in tl.static_range(PER_GROUP + 2):  # the group's query heads, then K, then V
            packed = packed_rows + (group * (PER_GROUP + 2) + part) * (2 * HALF)
            if part == PER_GROUP + 1:
                source, target = ends(packed, value_rows + group * (2 * HALF), BACKWARD)
                copy(source, target, mask, HALF)
            elif part == PER_GROUP:
                source, target = ends(packed, key_rows + group * (2 * HALF), BACKWARD)
                rotate(source, target, k11, k12, k21, k22, mask, HALF)
            else:
                source, target = ends(packed, query_rows + (group * PER_GROUP + part) * (2 * HALF), BACKWARD)
                rotate(source, target, q11, q12, q21, q22, mask, HALF)
