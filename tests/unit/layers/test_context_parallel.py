"""Context parallelism's arithmetic (core/layers/context_parallel.py): the load-balanced split of a sequence over
ranks, and attention over the whole sequence from each rank's share, equal to attention on one process (outputs
and the gradients of queries, keys and values), on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.layers.context_parallel import (
    attend_over_context,
    load_balanced_positions,
    packed_load_balanced_positions,
)
from tests.support.helpers import run_workers


def test_each_rank_holds_chunk_r_and_its_mirror_and_the_ranks_hold_every_token_once():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    for cp in (1, 2, 4):
        held = torch.cat([load_balanced_positions(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))
    with pytest.raises(ValueError, match="multiple of 4"):
        load_balanced_positions(10, 2, 0)
    with pytest.raises(ValueError, match="not a rank"):
        load_balanced_positions(8, 2, 2)


def test_packed_sequences_are_each_split_that_way_empty_slots_included():
    cu = torch.tensor([0, 8, 8, 12, 20], dtype=torch.int32)  # sequences of 8, 0, 4 and 8 tokens
    assert packed_load_balanced_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 18, 19]
    assert packed_load_balanced_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 14, 15, 16, 17]
    for cp in (1, 2):
        held = torch.cat([packed_load_balanced_positions(cu, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(20))
    with pytest.raises(ValueError, match="packed sequence of 6 tokens"):
        packed_load_balanced_positions(torch.tensor([0, 8, 14]), 2, 0)


def _reference(q, k, v, causal, sequences):
    """Attention on one process over the whole row, in float64."""
    per_group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    if sequences is not None:
        mask &= sequences[None, :] == sequences[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=q.shape[-1] ** -0.5)


def _compare_worker(case: str) -> dict:
    """On every rank: the same whole q, k, v and output weights; this rank's share attended over the context;
    its output and gradients against the one-process reference at this rank's positions. case: causal or "full"
    (no mask), one row or "packed" sequences, grouped-query attention or "mha"."""
    dist.init_process_group("gloo")
    try:
        return _compare(case, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def _compare(case: str, rank: int, size: int) -> dict:
    torch.manual_seed(0)
    length, heads, d = 16 * size, 4, 8
    groups = heads if "mha" in case else 2  # grouped-query attention, or a key and value head per query head
    q, k, v = (torch.randn(2, n, length, d, dtype=torch.float64) for n in (heads, groups, groups))
    weights = torch.randn(2, heads, length, d, dtype=torch.float64)
    causal, sequences = "full" not in case, None
    if case.startswith("packed"):
        lengths = [4 * size, 0, 8 * size, 4 * size]  # multiples of 2 x ranks; an empty slot
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        positions = packed_load_balanced_positions(cu, size, rank)
        whole_sequences = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        sequences = whole_sequences
    else:
        positions = load_balanced_positions(length, size, rank)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (_reference(*ref, causal, sequences) * weights).sum().backward()

    local = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    out = attend_over_context(
        *local, positions, dist.group.WORLD, causal, None if sequences is None else sequences[positions]
    )
    (out * weights[:, :, positions]).sum().backward()  # the ranks' terms add up to the reference's loss
    expected = _reference(q, k, v, causal, sequences)[:, :, positions]
    return {
        "output": (out.detach() - expected).abs().max().item(),
        **{f"grad_{n}": (t.grad - r.grad[:, :, positions]).abs().max().item() for n, t, r in zip("qkv", local, ref)},
    }


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", ["causal", "causal mha", "full", "packed", "packed full"])
def test_attention_over_the_context_equals_attention_on_one_process(case, ranks):
    for rank, diffs in enumerate(run_workers(ranks, _compare_worker, case)):
        assert max(diffs.values()) < 1e-12, (rank, diffs)


def _shared_gradient_worker() -> list[float]:
    dist.init_process_group("gloo")
    try:
        from core.layers.context_parallel import gather_along

        rank = dist.get_rank()
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        w = torch.arange(4.0, requires_grad=True)
        # The sum's backward hands one gradient tensor to both its inputs, and autograd runs the later-made node (the
        # gather's) first: the gather must not change that tensor in place.
        scaled = w * 1
        ((scaled + gather_along(x, 0, dist.group.WORLD)) * torch.arange(1.0, 5.0)).sum().backward()
        return [*w.grad.tolist(), *x.grad.tolist()]
    finally:
        dist.destroy_process_group()


def test_the_gathers_backward_leaves_a_gradient_other_inputs_share_alone():
    for rank, grads in enumerate(run_workers(2, _shared_gradient_worker)):
        assert grads[:4] == [1.0, 2.0, 3.0, 4.0], rank
        assert grads[4:] == ([2.0, 4.0] if rank == 0 else [6.0, 8.0]), rank  # both ranks' terms, this rank's part


def _layer_worker(layout: str) -> dict:
    """On every rank: the same twin TransformerLayer (float64) and the same whole input; this rank's share through
    the layer made context-parallel (set_context_parallel_group, as on TE's) against the whole input through the
    plain layer: outputs at this rank's positions, and the weights' gradients summed over the ranks."""
    dist.init_process_group("gloo")
    try:
        from core.layers.torch_twins import RotaryPositionEmbedding, TransformerLayer

        rank, size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        hidden, heads = 32, 4
        packed = layout == "thd"
        options = dict(
            num_gqa_groups=2,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            self_attn_mask_type="padding_causal" if packed else "causal",
            attn_input_format=layout,
            bias=False,
            activation="swiglu",
            normalization="RMSNorm",
            params_dtype=torch.float64,
        )
        layer, context = (TransformerLayer(hidden, 64, heads, **options).double() for _ in range(2))
        context.load_state_dict(layer.state_dict())
        context.set_context_parallel_group(dist.group.WORLD, list(range(size)))
        length = 8 * size
        angles = RotaryPositionEmbedding(hidden // heads)(length).double()
        weights = torch.randn(2 * length if packed else length, hidden, dtype=torch.float64)
        if packed:  # two rows of sequences 4 x size, 0 and 4 x size tokens, as one stream
            cu = torch.tensor([0, 4 * size, 4 * size, 8 * size, 12 * size, 16 * size], dtype=torch.int32)
            x = torch.randn(2 * length, hidden, dtype=torch.float64)
            positions = packed_load_balanced_positions(cu, size, rank)
            kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length, max_seqlen_kv=length)
            expected = layer(x, rotary_pos_emb=angles, **kwargs)
            out = context(x[positions], rotary_pos_emb=angles, **kwargs)  # whole angles: the layer finds positions
            (expected * weights).sum().backward()
            (out * weights[positions]).sum().backward()
            expected = expected[positions]
        else:
            x = torch.randn(2, length, hidden, dtype=torch.float64)
            positions = load_balanced_positions(length, size, rank)
            expected = layer(x, rotary_pos_emb=angles)
            out = context(x[:, positions], rotary_pos_emb=angles)  # the whole row's angles: the layer picks (as TE)
            (expected * weights).sum().backward()
            (out * weights[positions]).sum().backward()
            expected = expected[:, positions]
        diffs = {"output": (out - expected).abs().max().item()}
        for (name, p), q in zip(context.named_parameters(), layer.parameters()):
            dist.all_reduce(p.grad)  # each rank's tokens' share of the gradient
            diffs[name] = (p.grad - q.grad).abs().max().item()
        return diffs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_a_context_parallel_transformer_layer_equals_the_whole_one(layout):
    """The twin TransformerLayer given this rank's share and, as TE takes them, the whole row's rotary angles (bshd)
    or the whole stream's cu_seqlens (thd) gives the whole layer's output at those positions, and its weights'
    gradients add up over the ranks to the whole layer's."""
    for rank, diffs in enumerate(run_workers(2, _layer_worker, layout)):
        assert max(diffs.values()) < 1e-12, (rank, diffs)
