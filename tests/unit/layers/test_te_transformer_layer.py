"""PackedQKVSplit: the views TE's attention gets, and a packed gradient without copies when it can."""

import pytest
import torch

from core.layers.te_transformer_layer import PackedQKVSplit


class _PackedGradAttention(torch.autograd.Function):
    """Stands in for cuDNN attention: out = q*k + v, with dq, dk, dv written into one packed buffer."""

    @staticmethod
    def forward(ctx, q, k, v, dim):
        ctx.save_for_backward(q, k)
        ctx.dim = dim
        return q * k + v

    @staticmethod
    def backward(ctx, grad):
        q, k = ctx.saved_tensors
        packed = torch.empty(*q.shape[: ctx.dim], 3, *q.shape[ctx.dim :], dtype=grad.dtype)
        dq, dk, dv = (packed.select(ctx.dim, i) for i in range(3))
        dq.copy_(grad * k), dk.copy_(grad * q), dv.copy_(grad)
        _PackedGradAttention.buffers.append(packed)
        return dq, dk, dv, None

    buffers: list[torch.Tensor] = []


@pytest.mark.parametrize("dim", [-2, -3])
def test_packed_gradient_is_the_attention_buffer_itself(dim):
    torch.manual_seed(0)
    shape = [2, 5, 4, 8]
    shape.insert(len(shape) + dim + 1, 3)
    qkv = torch.randn(shape, requires_grad=True)
    reference = torch.randn(shape, requires_grad=True)
    with torch.no_grad():
        reference.copy_(qkv)

    grads_seen = []
    q, k, v = PackedQKVSplit.apply(qkv, dim)
    assert all(
        t.data_ptr() == qkv.data_ptr() + i * qkv.stride(dim) * qkv.element_size() for i, t in enumerate((q, k, v))
    )  # views, no copies
    out = _PackedGradAttention.apply(q, k, v, dim % len(shape))
    qkv.register_hook(grads_seen.append)
    _PackedGradAttention.buffers.clear()
    out.square().sum().backward()

    rq, rk, rv = (reference.select(dim, i) for i in range(3))
    (rq * rk + rv).square().sum().backward()
    torch.testing.assert_close(qkv.grad, reference.grad, rtol=0, atol=0)
    # The gradient handed to qkv is the buffer the attention backward wrote, not a copy of it.
    (packed,) = _PackedGradAttention.buffers
    assert grads_seen[0].data_ptr() == packed.data_ptr() and grads_seen[0].shape == qkv.shape


def test_gradients_in_separate_buffers_are_stacked():
    torch.manual_seed(1)
    qkv = torch.randn(2, 5, 4, 3, 8, requires_grad=True)
    q, k, v = PackedQKVSplit.apply(qkv, -2)
    (q * 2 + k.sin() + v * v).sum().backward()
    reference = qkv.detach().clone().requires_grad_()
    rq, rk, rv = reference.unbind(-2)
    (rq * 2 + rk.sin() + rv * rv).sum().backward()
    torch.testing.assert_close(qkv.grad, reference.grad, rtol=0, atol=0)


def test_wrong_packing_is_refused():
    with pytest.raises(ValueError, match="expected 3"):
        PackedQKVSplit.apply(torch.randn(2, 4, 2, 8), -2)
