"""Plain-PyTorch twins of the TransformerEngine modules the recipes use.

Each class takes the TE constructor arguments it supports, registers exactly TE's parameter names and
shapes, and computes what TE computes (TE's defaults included: tanh GELU, LayerNorm eps 1e-5,
softmax scale 1/sqrt(kv_channels), GLU gate in the first half of fc1), so a state dict moves between
the two backends with only TE's `_extra_state` entries differing. Arguments these twins do not
implement raise an error instead of being ignored. One addition TE lacks: the activation "gelu_erf" (the
exact GELU, as ESM-2 and Hugging Face compute it), for models that must equal those to float precision.

Packed sequences (attn_input_format "thd", TE's name): the input is [tokens, hidden], `cu_seqlens` [slots + 1]
the sequences' offsets (a slot may be empty); attention stays within each sequence and rotary positions restart
at each one's first token, as in TE.

Tensor parallelism works as in TE (and Megatron): with `tp_size > 1` a column-parallel layer holds a
block of output rows, a row-parallel one a block of input columns (marked with `partition_dim`, see
core/layers/tensor_parallel.py); the input of a column-parallel layer is all-reduced in the backward pass and the
output of a row-parallel one in the forward pass, over `tp_group`. Parameters may be plain tensors
(Megatron-FSDP hands the layers local tensors) or DTensors over the tensor-parallel mesh (FSDP2): the
layers compute with the local part either way.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from core.layers.context_parallel import attend_over_context, load_balanced_positions, packed_load_balanced_positions
from core.layers.tensor_parallel import GLU_ACTIVATIONS, mark_split

# TE's default init_method: normal(0, 0.023) for every weight; biases start at zero.
TE_DEFAULT_INIT_STD = 0.023


def _default_init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=TE_DEFAULT_INIT_STD)


def _reject(module: str, **options) -> None:
    """Fail loudly on a TE option whose non-default value the twin does not implement."""
    bad = {k: v for k, v in options.items() if v}
    if bad:
        raise NotImplementedError(
            f"{module}: the plain-torch layer backend does not support {bad}; use model.backend=te"
        )


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype or torch.get_default_dtype(), device=device))


def _local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's part of a parameter (a DTensor's local tensor; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the backward sums the input's gradient over the tensor-parallel ranks (each
    rank's column-parallel block contributed a part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sum of the ranks' partial outputs (a row-parallel layer's); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _tp_size(tp_size: int, tp_group, module: str) -> int:
    if tp_size > 1 and tp_group is None:
        raise ValueError(f"{module}: tp_size={tp_size} needs tp_group")
    return tp_size


def _divide(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp_size}")
    return n // tp_size


def _norm(
    x: torch.Tensor,
    kind: str,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    zero_centered_gamma: bool,
) -> torch.Tensor:
    w = weight + 1 if zero_centered_gamma else weight
    if kind == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, bias, eps)
    if kind == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {kind!r}")


def _init_norm(weight: torch.Tensor, bias: Optional[torch.Tensor], zero_centered_gamma: bool) -> None:
    with torch.no_grad():
        weight.fill_(0.0 if zero_centered_gamma else 1.0)
        if bias is not None:
            bias.zero_()


# Activations by TE's names. GLU variants: fc1 holds [gate; up]; activation applies to the gate half.
def _glu(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def glu(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return glu


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu_tanh,
    "gelu_erf": _gelu_erf,  # not a TE activation (see the module's docstring)
    "relu": F.relu,
    "silu": F.silu,
    "qgelu": _qgelu,
    "srelu": _srelu,
    "geglu": _glu(_gelu_tanh),
    "reglu": _glu(F.relu),
    "swiglu": _glu(F.silu),
    "qgeglu": _glu(_qgelu),
    "sreglu": _glu(_srelu),
}


class Linear(nn.Module):
    """te.Linear: `weight` [out, in], `bias` [out]. parallel_mode "column" splits the output rows over the
    tensor-parallel ranks, "row" the input columns (the bias then stays whole, added after the sum)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: Optional[Callable] = None,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        parallel_mode: Optional[str] = None,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        **unsupported,
    ):
        super().__init__()
        _reject("Linear", sequence_parallel=sequence_parallel, **unsupported)
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode={parallel_mode!r}: expected None, 'column' or 'row'")
        self.tp_size, self.tp_group = _tp_size(tp_size, tp_group, "Linear"), tp_group
        self.parallel_mode = parallel_mode if self.tp_size > 1 else None
        self.in_features, self.out_features = in_features, out_features
        rows = _divide(out_features, self.tp_size, "out_features") if self.parallel_mode == "column" else out_features
        cols = _divide(in_features, self.tp_size, "in_features") if self.parallel_mode == "row" else in_features
        self.weight = _param((rows, cols), params_dtype, device)
        self.bias = _param((rows,), params_dtype, device) if bias else None
        (init_method or _default_init)(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.parallel_mode == "column":
            mark_split(self.weight, 0)
            if self.bias is not None:
                mark_split(self.bias, 0)
        elif self.parallel_mode == "row":
            mark_split(self.weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _local(self.weight), _local(self.bias)
        if self.parallel_mode == "column":
            return F.linear(_CopyToTensorParallel.apply(x, self.tp_group), weight, bias)
        if self.parallel_mode == "row":
            y = _ReduceFromTensorParallel.apply(F.linear(x, weight), self.tp_group)
            return y + bias if bias is not None else y
        return F.linear(x, weight, bias)


class LayerNorm(nn.Module):
    """te.LayerNorm: `weight`, `bias`."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        **unsupported,
    ):
        super().__init__()
        _reject("LayerNorm", **unsupported)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = _param((hidden_size,), params_dtype, device)
        self.bias = _param((hidden_size,), params_dtype, device)
        _init_norm(self.weight, self.bias, zero_centered_gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, "LayerNorm", _local(self.weight), _local(self.bias), self.eps, self.zero_centered_gamma)


class RMSNorm(nn.Module):
    """te.RMSNorm: `weight`."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        **unsupported,
    ):
        super().__init__()
        _reject("RMSNorm", **unsupported)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = _param((hidden_size,), params_dtype, device)
        _init_norm(self.weight, None, zero_centered_gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, "RMSNorm", _local(self.weight), None, self.eps, self.zero_centered_gamma)


class LayerNormLinear(nn.Module):
    """te.LayerNormLinear: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), then either one
    `weight`/`bias`, or with `parameters_split` one `<name>_weight`/`<name>_bias` per split (concatenated
    along the output dimension in the given order). parallel_mode "column" splits every output block
    over the tensor-parallel ranks. return_layernorm_output: (output, normalized input), as TE."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        init_method: Optional[Callable] = None,
        parameters_split: Optional[dict[str, int]] = None,
        zero_centered_gamma: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        parallel_mode: Optional[str] = None,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        return_layernorm_output: bool = False,
        **unsupported,
    ):
        super().__init__()
        self.return_layernorm_output = return_layernorm_output
        _reject("LayerNormLinear", sequence_parallel=sequence_parallel, **unsupported)
        if parallel_mode not in (None, "column"):
            raise NotImplementedError(
                f"LayerNormLinear: parallel_mode={parallel_mode!r} (the torch backend: None or 'column')"
            )
        self.tp_size, self.tp_group = _tp_size(tp_size, tp_group, "LayerNormLinear"), tp_group
        self.column_parallel = parallel_mode == "column" and self.tp_size > 1
        self.parallel_mode = "column" if self.column_parallel else None
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.layer_norm_weight = _param((in_features,), params_dtype, device)
        self.layer_norm_bias = _param((in_features,), params_dtype, device) if normalization == "LayerNorm" else None
        _init_norm(self.layer_norm_weight, self.layer_norm_bias, zero_centered_gamma)
        splits = parameters_split or {"": out_features}
        if sum(splits.values()) != out_features:
            raise ValueError(f"parameters_split {splits} does not add up to out_features={out_features}")
        self._weight_names, self._bias_names = [], []
        for name, size in splits.items():
            prefix = f"{name}_" if name else ""
            if self.column_parallel:
                size = _divide(size, self.tp_size, f"output block {prefix + 'weight'!r}")
            w = _param((size, in_features), params_dtype, device)
            (init_method or _default_init)(w)
            self.register_parameter(prefix + "weight", mark_split(w, 0) if self.column_parallel else w)
            self._weight_names.append(prefix + "weight")
            if bias:
                b = _param((size,), params_dtype, device)
                nn.init.zeros_(b)
                self.register_parameter(prefix + "bias", mark_split(b, 0) if self.column_parallel else b)
                self._bias_names.append(prefix + "bias")

    def forward(self, x: torch.Tensor):
        normalized = _norm(
            x,
            self.normalization,
            _local(self.layer_norm_weight),
            _local(self.layer_norm_bias),
            self.eps,
            self.zero_centered_gamma,
        )
        x = _CopyToTensorParallel.apply(normalized, self.tp_group) if self.column_parallel else normalized
        weights = [_local(getattr(self, n)) for n in self._weight_names]
        biases = [_local(getattr(self, n)) for n in self._bias_names]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        bias = (torch.cat(biases) if len(biases) > 1 else biases[0]) if biases else None
        out = F.linear(x, weight, bias)
        return (out, normalized) if self.return_layernorm_output else out


class LayerNormMLP(nn.Module):
    """te.LayerNormMLP: `layer_norm_weight`, `layer_norm_bias`, `fc1_weight` [ffn (x2 for GLU), hidden],
    `fc1_bias`, `fc2_weight` [hidden, ffn], `fc2_bias`. set_parallel_mode: fc1 column-parallel (a GLU's
    rank holds [its gate rows; its up rows], as TE), fc2 row-parallel."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        zero_centered_gamma: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        set_parallel_mode: bool = False,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        **unsupported,
    ):
        super().__init__()
        _reject("LayerNormMLP", sequence_parallel=sequence_parallel, **unsupported)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.tp_size, self.tp_group = _tp_size(tp_size, tp_group, "LayerNormMLP"), tp_group
        self.parallel = self.set_parallel_mode = set_parallel_mode and self.tp_size > 1
        ffn = _divide(ffn_hidden_size, self.tp_size, "ffn_hidden_size") if self.parallel else ffn_hidden_size
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.activation = activation  # TE's name (core/layers/tensor_parallel.py reads it to find GLU weights)
        self._activation = ACTIVATIONS[activation]
        fc1_out = 2 * ffn if activation in GLU_ACTIVATIONS else ffn
        self.layer_norm_weight = _param((hidden_size,), params_dtype, device)
        self.layer_norm_bias = _param((hidden_size,), params_dtype, device) if normalization == "LayerNorm" else None
        _init_norm(self.layer_norm_weight, self.layer_norm_bias, zero_centered_gamma)
        self.fc1_weight = _param((fc1_out, hidden_size), params_dtype, device)
        self.fc1_bias = _param((fc1_out,), params_dtype, device) if bias else None
        self.fc2_weight = _param((hidden_size, ffn), params_dtype, device)
        self.fc2_bias = _param((hidden_size,), params_dtype, device) if bias else None
        (init_method or _default_init)(self.fc1_weight)
        (output_layer_init_method or _default_init)(self.fc2_weight)
        for b in (self.fc1_bias, self.fc2_bias):
            if b is not None:
                nn.init.zeros_(b)
        if self.parallel:
            mark_split(self.fc1_weight, 0)
            mark_split(self.fc2_weight, 1)
            if self.fc1_bias is not None:
                mark_split(self.fc1_bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _norm(
            x,
            self.normalization,
            _local(self.layer_norm_weight),
            _local(self.layer_norm_bias),
            self.eps,
            self.zero_centered_gamma,
        )
        if self.parallel:
            x = _CopyToTensorParallel.apply(x, self.tp_group)
        x = self._activation(F.linear(x, _local(self.fc1_weight), _local(self.fc1_bias)))
        y = F.linear(x, _local(self.fc2_weight))
        if self.parallel:
            y = _ReduceFromTensorParallel.apply(y, self.tp_group)
        return y + _local(self.fc2_bias) if self.fc2_bias is not None else y


class RotaryPositionEmbedding(nn.Module):
    """te.RotaryPositionEmbedding: no parameters; buffer `inv_freq`. forward(max_seq_len) gives the angles
    [s, 1, 1, dim] (float32), each frequency repeated for the two halves of the head dimension (TE's non-interleaved
    layout, applied by `apply_rotary_pos_emb`)."""

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[int] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
        **unsupported,
    ):
        super().__init__()
        _reject(
            "RotaryPositionEmbedding",
            rotary_percent=rotary_percent != 1.0,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            pretrained_max_position_embeddings=pretrained_max_position_embeddings,
            interleaved=interleaved,
            **unsupported,
        )
        inv_freq = 1.0 / rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq)  # in the state dict, as TE's is

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        freqs = torch.outer(positions, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first freqs.shape[-1] channels of t [b, s, heads, d] by the angles freqs [s, 1, 1, d']:
    t * cos + rotate_half(t) * sin, rotate_half([x1, x2]) = [-x2, x1] (TE's unfused formula)."""
    rot_dim = freqs.shape[-1]
    angles = freqs[: t.shape[1]].transpose(0, 1)  # [1, s, 1, d']
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    rot, rest = t[..., :rot_dim], t[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated


class InferenceParams:
    """te.InferenceParams with its default non-paged cache, for the bshd layout: per layer a key and a value
    cache [max_batch_size, max_sequence_length, kv heads, head_dim], allocated on first use.

    As with TE: call `pre_step(OrderedDict({sequence id: new tokens}))` before each forward pass, then run
    the model with `inference_params=` and an attention mask type containing "padding" (the new queries
    attend to every cached position and causally among themselves). The twin supports what generation
    needs: a batch whose sequences all start together and advance by the same number of tokens.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        num_heads_kv: Optional[int] = None,
        head_dim_k: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        head_dim_v: Optional[int] = None,
        is_paged: bool = False,
        qkv_format: str = "bshd",
        **unsupported,
    ):
        _reject("InferenceParams", is_paged=is_paged, qkv_format=qkv_format != "bshd", **unsupported)
        if num_heads_kv is None or head_dim_k is None or dtype is None:
            raise ValueError("InferenceParams needs num_heads_kv, head_dim_k and dtype (as TE's does)")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.num_heads_kv, self.head_dim_k, self.head_dim_v = num_heads_kv, head_dim_k, head_dim_v or head_dim_k
        self.dtype = dtype
        self.sequences: OrderedDict = OrderedDict()  # sequence id -> tokens cached after this step
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer number -> (keys, values)
        self.sequence_start = 0  # tokens cached before this step (the new tokens' first position)

    def reset(self) -> None:
        self.sequences = OrderedDict()

    def pre_step(self, step_dict: OrderedDict) -> OrderedDict:
        new_tokens = set(step_dict.values())
        if len(new_tokens) != 1 or len(step_dict) > self.max_batch_size:
            raise NotImplementedError(
                f"InferenceParams (torch backend): every sequence of a step must add the same "
                f"number of tokens, at most {self.max_batch_size} sequences; got {dict(step_dict)}"
            )
        if self.sequences and list(step_dict) != list(self.sequences):
            raise NotImplementedError(
                "InferenceParams (torch backend): a step must continue the same sequences (reset() to start new ones)"
            )
        start = next(iter(self.sequences.values())) if self.sequences else 0
        end = start + new_tokens.pop()
        if end > self.max_sequence_length:
            raise ValueError(
                f"the KV cache holds {self.max_sequence_length} tokens per sequence; this step needs {end}"
            )
        self.sequence_start = start
        self.sequences = OrderedDict((key, end) for key in step_dict)
        return self.sequences

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values [batch, new tokens, kv heads, head_dim] at their positions; return the
        cached ones up to and including them."""
        if layer_number not in self.cache:
            shape = (self.max_batch_size, self.max_sequence_length, self.num_heads_kv)
            self.cache[layer_number] = (
                new_k.new_zeros(*shape, self.head_dim_k, dtype=self.dtype),
                new_v.new_zeros(*shape, self.head_dim_v, dtype=self.dtype),
            )
        keys, values = self.cache[layer_number]
        b, end = new_k.shape[0], self.sequence_start + new_k.shape[1]
        keys[:b, self.sequence_start : end] = new_k
        values[:b, self.sequence_start : end] = new_v
        return keys[:b, :end], values[:b, :end]


def _check_attention_options(
    qkv_format: str,
    attn_mask_type: str,
    fuse_qkv_params: bool,
    qkv_weight_interleaved: bool,
    num_heads: int,
    num_groups: int,
) -> None:
    """Fail on a mask, token layout, QKV weight layout or head grouping the twin does not implement (or TE
    rejects)."""
    packed_masks = ("padding", "padding_causal")
    if qkv_format == "thd" and attn_mask_type not in packed_masks:
        raise ValueError(f"qkv_format='thd' needs attn_mask_type in {packed_masks} (as TE), got {attn_mask_type!r}")
    if qkv_format != "thd" and attn_mask_type not in ("no_mask", "causal"):
        raise NotImplementedError(
            f"attn_mask_type={attn_mask_type!r}: the torch backend supports no_mask and causal "
            "(padding masks: packed sequences, qkv_format='thd')"
        )
    if qkv_format not in ("sbhd", "bshd", "thd"):
        raise NotImplementedError(f"qkv_format={qkv_format!r}: the torch backend supports sbhd, bshd and thd")
    if fuse_qkv_params and not qkv_weight_interleaved:
        raise NotImplementedError("fuse_qkv_params without qkv_weight_interleaved")
    if num_heads % num_groups:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by num_gqa_groups={num_groups}")


class MultiheadAttention(nn.Module):
    """te.MultiheadAttention (self-attention, input layernorm): `layernorm_qkv.*` and `proj.*`.

    fuse_qkv_params=False: `layernorm_qkv.{query,key,value}_{weight,bias}`.
    fuse_qkv_params=True: one `layernorm_qkv.weight` whose rows are grouped per KV group as
    [queries of the group, key, value] (TE's qkv_weight_interleaved=True layout).
    set_parallel_mode: each tensor-parallel rank computes a block of the KV groups (with their query
    heads): `layernorm_qkv` column-parallel, `proj` row-parallel.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method=None,
        output_layer_init_method=None,
        attn_mask_type: str = "causal",
        num_gqa_groups: Optional[int] = None,
        fuse_qkv_params: bool = False,
        qkv_weight_interleaved: bool = True,
        bias: bool = True,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        qkv_format: str = "sbhd",
        params_dtype=None,
        device=None,
        set_parallel_mode: bool = False,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        layer_number: Optional[int] = None,
    ):
        super().__init__()
        _reject("MultiheadAttention", sequence_parallel=sequence_parallel)
        self.layer_number = layer_number  # names this layer's KV cache
        self.num_heads = num_attention_heads
        self.num_groups = num_gqa_groups or num_attention_heads
        _check_attention_options(
            qkv_format, attn_mask_type, fuse_qkv_params, qkv_weight_interleaved, self.num_heads, self.num_groups
        )
        self.head_dim = kv_channels or hidden_size // num_attention_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_groups * self.head_dim
        tp_size = _tp_size(tp_size, tp_group, "MultiheadAttention") if set_parallel_mode else 1
        # This rank's heads and groups (all of them without tensor parallelism).
        self.num_heads = _divide(self.num_heads, tp_size, "num_attention_heads")
        self.num_groups = _divide(self.num_groups, tp_size, "num_gqa_groups")
        self.attention_dropout = attention_dropout
        self.causal = attn_mask_type in ("causal", "padding_causal")
        self.qkv_format = qkv_format
        self.cp_group, self.cp_size, self.cp_rank = None, 1, 0  # set_context_parallel_group
        self.fuse_qkv_params = fuse_qkv_params
        parallel = dict(tp_group=tp_group, tp_size=tp_size) if tp_size > 1 else {}
        common = dict(
            eps=layernorm_epsilon,
            bias=bias,
            normalization=normalization,
            init_method=init_method,
            zero_centered_gamma=zero_centered_gamma,
            params_dtype=params_dtype,
            device=device,
            parallel_mode="column" if parallel else None,
            **parallel,
        )
        if fuse_qkv_params:
            self.layernorm_qkv = LayerNormLinear(hidden_size, q_size + 2 * kv_size, **common)
        else:
            split = {"query": q_size, "key": kv_size, "value": kv_size}
            self.layernorm_qkv = LayerNormLinear(hidden_size, q_size + 2 * kv_size, parameters_split=split, **common)
        self.proj = Linear(
            q_size,
            hidden_size,
            bias=bias,
            init_method=output_layer_init_method,
            params_dtype=params_dtype,
            device=device,
            parallel_mode="row" if parallel else None,
            **parallel,
        )

    def _split_qkv(self, mixed: torch.Tensor, b: int, s: int) -> tuple[torch.Tensor, ...]:
        """The projection's output [b, s, ...] -> q [b, s, heads, d], k and v [b, s, groups, d]."""
        per_group = self.num_heads // self.num_groups
        if self.fuse_qkv_params:
            mixed = mixed.view(b, s, self.num_groups, (per_group + 2) * self.head_dim)
            q, k, v = mixed.split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
            return q.reshape(b, s, self.num_heads, self.head_dim), k, v
        q_size, kv_size = self.num_heads * self.head_dim, self.num_groups * self.head_dim
        q, k, v = mixed.split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(b, s, self.num_heads, self.head_dim),
            k.view(b, s, self.num_groups, self.head_dim),
            v.view(b, s, self.num_groups, self.head_dim),
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        inference_params: Optional[InferenceParams] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        causal: Optional[bool] = None,
        cu_seqlens_padded: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """causal: packed sequences only, the call's mask type (None: the constructor's), as TE takes it per call.
        cu_seqlens_padded: packed sequences laid out with padding after each (TE's): cu_seqlens then add up their
        real lengths, and no real token attends to the padding."""
        if self.qkv_format == "thd":
            if cu_seqlens is None or inference_params is not None:
                raise ValueError("qkv_format='thd' needs cu_seqlens (and takes no KV cache)")
            causal = self.causal if causal is None else causal
            return self._packed(x, rotary_pos_emb, cu_seqlens, causal, cu_seqlens_padded)
        if causal is not None:
            raise NotImplementedError("causal: a per-call mask type for packed sequences (qkv_format='thd') only")
        if cu_seqlens is not None:
            raise NotImplementedError("cu_seqlens: packed sequences need qkv_format='thd'")
        if self.cp_size > 1 and inference_params is not None:
            raise NotImplementedError("a KV cache with context parallelism")
        if self.qkv_format == "sbhd":
            x = x.transpose(0, 1)  # compute in [batch, seq, hidden]
        b, s, _ = x.shape
        q, k, v = self._split_qkv(self.layernorm_qkv(x), b, s)
        start = inference_params.sequence_start if inference_params is not None else 0
        positions = None
        if self.cp_size > 1:  # this rank's share of each row, at these places in it
            positions = load_balanced_positions(s * self.cp_size, self.cp_size, self.cp_rank, x.device)
        if rotary_pos_emb is not None:  # positions enter through queries and keys only
            # the new tokens continue after the cached ones; with context parallelism the angles are the whole
            # row's, and this rank's are picked (as TE's rotary embedding does)
            angles = rotary_pos_emb[start:] if positions is None else rotary_pos_emb[positions]
            q, k = apply_rotary_pos_emb(q, angles), apply_rotary_pos_emb(k, angles)
        if inference_params is not None:
            if self.layer_number is None:
                raise ValueError("MultiheadAttention needs a layer_number to use a KV cache")
            k, v = inference_params.step(self.layer_number, k, v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        if positions is not None:
            out = attend_over_context(q, k, v, positions, self.cp_group, self.causal, dropout_p=self._dropout())
            out = self.proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))
            return out.transpose(0, 1) if self.qkv_format == "sbhd" else out
        causal, mask = self.causal, None
        if self.causal and start > 0:  # queries at positions start.. see every cached key and the new ones before them
            causal = False
            if s > 1:
                mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = self._attend(q, k, v, mask, causal)
        out = self.proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))
        return out.transpose(0, 1) if self.qkv_format == "sbhd" else out

    def _attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """q, k, v [b, heads, s, d] -> the attention's output, [b, heads, s, d]."""
        per_group = self.num_heads // self.num_groups
        if per_group > 1:
            k = k.repeat_interleave(per_group, dim=1)
            v = v.repeat_interleave(per_group, dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self._dropout(),
            scale=1.0 / math.sqrt(self.head_dim),
        )

    def _dropout(self) -> float:
        return self.attention_dropout if self.training else 0.0

    def _packed(
        self,
        x: torch.Tensor,
        rotary_pos_emb: Optional[torch.Tensor],
        cu_seqlens: torch.Tensor,
        causal: bool,
        cu_seqlens_padded: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x [tokens, hidden] holding the sequences cu_seqlens delimits -> [tokens, hidden]. Tokens past the last
        offset form one more sequence of their own. causal: each token sees its sequence's tokens up to itself.
        With context parallelism, as with TE: x holds this rank's share of every sequence and cu_seqlens delimits the
        whole stream (each sequence a multiple of 2 x cp_size tokens); positions count from each sequence's start."""
        t = x.shape[0]
        layout = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
        if self.cp_size > 1:
            index = self._context_share(layout, t)
            sequence, position = packed_positions(layout, int(layout[-1]))
            sequence, position = sequence[index], position[index]
        else:
            index = torch.arange(t, device=x.device)
            sequence, position = packed_positions(layout, t)
        real = None
        if cu_seqlens_padded is not None:  # each sequence's first tokens are real, the rest of its slot padding
            lengths = torch.cat([cu_seqlens.long().diff(), cu_seqlens.new_zeros(1, dtype=torch.long)])
            real = position < lengths[sequence]
        q, k, v = self._split_qkv(self.layernorm_qkv(x[None]), 1, t)
        if rotary_pos_emb is not None:  # each sequence's positions start at 0
            angles = rotary_pos_emb[position]
            q, k = apply_rotary_pos_emb(q, angles), apply_rotary_pos_emb(k, angles)
        q, k, v = (u.transpose(1, 2) for u in (q, k, v))
        if self.cp_size > 1:
            out = attend_over_context(q, k, v, index, self.cp_group, causal, sequence, self._dropout(), real)
        else:
            mask = sequence[:, None] == sequence[None, :]
            if real is not None:  # padding is no real token's key; a padding query sees itself (defined, unused)
                mask = mask & (real[None, :] | (index[None, :] == index[:, None]))
            out = self._attend(q, k, v, mask.tril() if causal else mask, False)
        return self.proj(out.transpose(1, 2).reshape(t, self.num_heads * self.head_dim))

    def _context_share(self, cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
        """The places in the whole packed stream of this rank's `tokens` tokens."""
        total = int(cu_seqlens[-1])
        if tokens * self.cp_size != total:
            raise ValueError(
                f"context parallelism over {self.cp_size} ranks: cu_seqlens covers {total} tokens, but this rank "
                f"holds {tokens} (every token of the stream must belong to a sequence)"
            )
        return packed_load_balanced_positions(cu_seqlens, self.cp_size, self.cp_rank)


class TransformerLayer(nn.Module):
    """te.TransformerLayer, pre-norm self-attention + MLP: `self_attention.*`, `layernorm_mlp.*`."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method=None,
        output_layer_init_method=None,
        layer_number: Optional[int] = None,
        kv_channels: Optional[int] = None,
        self_attn_mask_type: str = "causal",
        fuse_qkv_params: bool = False,
        qkv_weight_interleaved: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        attn_input_format: str = "sbhd",
        params_dtype=None,
        device=None,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        set_parallel_mode: bool = False,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        drop_path_rate: float = 0.0,
        **unsupported,
    ):
        super().__init__()
        _reject(
            "TransformerLayer",
            apply_residual_connection_post_layernorm=apply_residual_connection_post_layernorm,
            output_layernorm=output_layernorm,
            sequence_parallel=sequence_parallel,
            drop_path_rate=drop_path_rate,
            **unsupported,
        )
        parallel = dict(set_parallel_mode=set_parallel_mode, tp_group=tp_group, tp_size=tp_size)
        self.hidden_dropout = hidden_dropout
        self.self_attention = MultiheadAttention(
            hidden_size,
            num_attention_heads,
            kv_channels=kv_channels,
            attention_dropout=attention_dropout,
            layernorm_epsilon=layernorm_epsilon,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            attn_mask_type=self_attn_mask_type,
            num_gqa_groups=num_gqa_groups,
            fuse_qkv_params=fuse_qkv_params,
            qkv_weight_interleaved=qkv_weight_interleaved,
            bias=bias,
            normalization=normalization,
            zero_centered_gamma=zero_centered_gamma,
            qkv_format=attn_input_format,
            params_dtype=params_dtype,
            device=device,
            layer_number=layer_number,
            **parallel,
        )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            bias=bias,
            normalization=normalization,
            activation=activation,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            zero_centered_gamma=zero_centered_gamma,
            params_dtype=params_dtype,
            device=device,
            **parallel,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        inference_params: Optional[InferenceParams] = None,
        self_attn_mask_type: Optional[str] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        pad_between_seqs: Optional[bool] = None,
        **unsupported,
    ) -> torch.Tensor:
        if attention_mask is not None or any(v is not None for v in unsupported.values()):
            raise NotImplementedError("the torch TransformerLayer takes no attention_mask or extra forward arguments")
        if cu_seqlens_kv is not None and cu_seqlens_kv is not cu_seqlens_q:
            raise NotImplementedError("self-attention over packed sequences: cu_seqlens_kv must be cu_seqlens_q")
        if cu_seqlens_kv_padded is not cu_seqlens_q_padded:
            raise NotImplementedError("self-attention over padded sequences: cu_seqlens_kv_padded must be the q's")
        # pad_between_seqs: TE's hint that the padded offsets differ from the real ones; the mask here needs none.
        # max_seqlen_*: a bound TE's kernels size their work by; the masked attention here needs none.
        if self.self_attention.qkv_format == "thd":
            if self_attn_mask_type not in (None, "padding", "padding_causal"):
                raise NotImplementedError(f"self_attn_mask_type={self_attn_mask_type!r} with packed sequences")
            # The call's mask type wins over the constructor's, as in TE (a causal model run on packed documents).
            causal = None if self_attn_mask_type is None else self_attn_mask_type == "padding_causal"
            x = hidden_states
            attended = self.self_attention(
                x, rotary_pos_emb, cu_seqlens=cu_seqlens_q, causal=causal, cu_seqlens_padded=cu_seqlens_q_padded
            )
            x = x + F.dropout(attended, self.hidden_dropout, self.training)
            return x + F.dropout(self.layernorm_mlp(x), self.hidden_dropout, self.training)
        # With a KV cache TE wants a padding mask type; the twin's sequences have no padding, so the
        # padding variants are the same mask as the constructor's.
        if self_attn_mask_type not in (None, "causal", "padding_causal") or (
            self_attn_mask_type is not None and not self.self_attention.causal
        ):
            raise NotImplementedError(
                f"self_attn_mask_type={self_attn_mask_type!r} (the torch backend: causal or "
                "padding_causal on a causal layer)"
            )
        x = hidden_states
        x = x + F.dropout(self.self_attention(x, rotary_pos_emb, inference_params), self.hidden_dropout, self.training)
        return x + F.dropout(self.layernorm_mlp(x), self.hidden_dropout, self.training)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream=None, cp_comm_type: str = "p2p") -> None:
        """TE's: attend over the tokens of every rank of `cp_group`, each holding its share of every sequence
        (core/layers/context_parallel.py); the stream and communication type are TE's kernels' concern."""
        attention = self.self_attention
        attention.cp_group = cp_group
        attention.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        attention.cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0


def packed_positions(cu_seqlens: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `tokens` packed tokens whose sequences start at cu_seqlens[:-1] (int32 offsets, empty slots allowed):
    each token's sequence (its slot; tokens past cu_seqlens[-1]: one more) and its position in it."""
    offsets = cu_seqlens.long()
    index = torch.arange(tokens, device=offsets.device)
    sequence = torch.searchsorted(offsets[1:], index, right=True)
    start = torch.cat([offsets, offsets[-1:]])[sequence]  # the slot past the last starts at its offset
    return sequence, index - start


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per label in fp32 (TE's parallel_cross_entropy computes in fp32 too)."""
    flat = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
    return flat.view(labels.shape)
