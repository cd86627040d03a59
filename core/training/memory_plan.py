"""How much memory a training run takes on each GPU, estimated from its settings before anything is built
(for any machine, without a GPU: scripts/memory_plan.py).

A run holds, per GPU (bytes per parameter on the left, what divides them on the right):
  weights           the compute copy (bf16: 2, fp32: 4)            ZeRO-3 / FSDP2: over dp_shard x cp
  master weights    fp32 copies of the trained weights (4)          ZeRO >= 1 / FSDP2
  gradients         fp32 main gradients of the trained weights (4)  ZeRO >= 2 / FSDP2
  optimizer state   AdamW's two fp32 moments (8)                    ZeRO >= 1 / FSDP2
  gathered units    ZeRO-3's whole blocks in flight (two, and one block's gradients)
  activations       what each block keeps per token for its backward (below), times tokens per micro-batch
  logits            the output layer's bf16 logits per token (language models)
  workspace         GEMM and attention workspaces and the allocator's slack (a constant), and one block's
                    activation gradients, which its backward holds while it runs
Frozen weights (finetune.mode=lora or frozen) take their compute copy only. Tensor parallelism divides the weights'
parts and the blocks' inner activations; context parallelism (distributed.cp) the tokens of each sample, and the
sharded parts with dp_shard (the backends shard over both). Activations per token and block, in elements of the
compute dtype: the attention's input and normalized input, query, key, value and output (4 h + 2 kv), the MLP's input,
normalized input, first and activated outputs (2 h + 3 f gated, 2 h + 2 f otherwise); a frozen block keeps what its
backward to the input needs (4 h + 2 kv, and h + 2 f gated or h + f); activation checkpointing keeps each block's
input and one block's whole set. It counts what torch allocates (torch.cuda.max_memory_allocated), which is what the
logs' peak memory reports; docs/performance.md compares it with measured peaks.

A run that would not fit its GPU stops before building the model, naming settings that would fit
(`training.memory_plan=warn` only warns, `off` skips the plan).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Optional

import torch
from omegaconf import DictConfig

from core.config.errors import ConfigError
from core.training.precision import DTYPES

GIB = 2**30
WORKSPACE_BYTES = 0.125 * GIB
# Above this share of the GPU's memory a plan warns: the allocator's fragmentation and the CUDA context need room.
WARN_SHARE = 0.9


@dataclass(frozen=True)
class BlockShape:
    """What the memory of a recipe's transformer depends on (Recipe.block_shape)."""

    layers: int
    hidden: int
    ffn: int
    kv: int  # width of the key (and of the value) projection: hidden, or fewer with grouped queries
    gated: bool  # SwiGLU: the first MLP layer writes 2 x ffn
    logits: int = 0  # outputs kept per token for the loss (a language model's vocabulary); 0: per sample


@dataclass(frozen=True)
class Parameters:
    total: int
    trained: int
    unit: int  # the largest block's parameters (what ZeRO-3 gathers at once)
    blocks_trained: str  # "all", "some" (adapters) or "none": how much of the blocks trains


@dataclass(frozen=True)
class Settings:
    """The settings a plan depends on, and that advice may change."""

    backend: str  # mfsdp, fsdp2 or ddp
    zero: int  # Megatron-FSDP's zero_dp_strategy (FSDP2: 3, DDP: 0)
    dp_shard: int
    tp: int
    micro_batch: int
    tokens: int  # per sample
    activation_checkpointing: bool
    param_bytes: int  # the compute copy's dtype
    compute_bytes: int  # activations' dtype (autocast's, else the weights')
    fp8: bool
    cp: int = 1  # context parallelism: each GPU holds 1/cp of each sample's tokens


@dataclass(frozen=True)
class MemoryPlan:
    parts: dict[str, float]  # bytes, by what holds them
    settings: Settings

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def lines(self, capacity: Optional[float] = None) -> list[str]:
        s = self.settings
        head = (
            f"memory plan per GPU: ~{self.total / GIB:.1f} GiB"
            + (f" of {capacity / GIB:.1f} GiB" if capacity else "")
            + f" ({s.backend} ZeRO-{s.zero} over {s.dp_shard * max(s.cp, 1)}, tp={s.tp}"
            + (f", cp={s.cp}" if s.cp > 1 else "")
            + f", micro-batch {s.micro_batch} x "
            f"{s.tokens} tokens{', activation checkpointing' if s.activation_checkpointing else ''})"
        )
        return [head] + [f"  {name:<16} {value / GIB:8.2f} GiB" for name, value in self.parts.items() if value]


def estimate(block: BlockShape, params: Parameters, s: Settings) -> MemoryPlan:
    shard = max(s.dp_shard, 1) * max(s.cp, 1)
    tp = max(s.tp, 1)
    total, trained = params.total / tp, params.trained / tp
    frozen = total - trained
    weights_div = shard if s.zero >= 3 else 1
    parts = {
        "weights": (trained * s.param_bytes + frozen * min(s.param_bytes, s.compute_bytes)) / weights_div,
        "master weights": trained * 4 / (shard if s.zero >= 1 else 1) if s.backend != "ddp" else 0.0,
        "gradients": trained * 4 / (shard if s.zero >= 2 else 1),
        "optimizer state": trained * 8 / (shard if s.zero >= 1 else 1),
        "gathered units": 0.0,
        "activations": 0.0,
        "logits": 0.0,
        "workspace": 0.0,
    }
    if s.backend == "ddp":  # the fp32 weights are the master weights; autocast keeps a compute copy per block
        parts["weights"] = total * 4
    if s.param_bytes > s.compute_bytes:  # autocast's casts of the weights, kept for the backward
        parts["weights"] += total * s.compute_bytes / weights_div
    if s.fp8:  # TE's FP8 copies of the GEMM weights and their transposes
        parts["weights"] += 2 * total / weights_div
    if s.zero >= 3 and shard > 1:
        unit = params.unit / tp
        parts["gathered units"] = unit * (2 * s.param_bytes + (4 if params.blocks_trained != "none" else 0))
    tokens = s.micro_batch * s.tokens / max(s.cp, 1)
    per_block = _block_activation_bytes(block, params.blocks_trained, s)
    parts["activations"] = tokens * (block.layers * per_block)
    if s.activation_checkpointing:  # each block's input, and one block recomputed at a time
        parts["activations"] = tokens * (block.layers * block.hidden * s.compute_bytes + per_block)
    parts["workspace"] = WORKSPACE_BYTES + tokens * per_block
    parts["logits"] = tokens * block.logits * s.compute_bytes / tp
    return MemoryPlan(parts, s)


def _block_activation_bytes(block: BlockShape, blocks_trained: str, s: Settings) -> float:
    """Bytes a token keeps in one block until its backward."""
    if blocks_trained == "none":  # no gradient reaches the blocks: the forward keeps nothing for them
        return 0.0
    h, f, kv = block.hidden, block.ffn, block.kv
    first = 2 * f if block.gated else f  # the MLP's first output
    split = (h + 2 * kv) + h + first  # q, k, v; the attention's output; the MLP's first output (split over TP)
    whole = 3 * h  # the two normalizations' inputs, the attention's normalized input (whole on every TP rank)
    if blocks_trained == "all":  # the MLP's normalized input and activated output feed weight gradients too
        split, whole = split + f, whole + h
    return (split / max(s.tp, 1) + whole) * s.compute_bytes


def count_parameters(recipe, cfg: DictConfig) -> Parameters:
    """The recipe's model built on the meta device (shapes only: no memory, no initialization) with the plain-torch
    layers (the TE layers' twins: the same parameters), made to train what finetune.mode says."""
    from core.layers.namespace import TORCH_LAYERS
    from core.training import finetune

    model = recipe.build_model(TORCH_LAYERS, torch.device("meta"))
    finetune.apply(model, cfg.finetune, cfg.seed, torch.bfloat16, 1)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    units = tuple(recipe.unit_modules(TORCH_LAYERS))
    blocks = [m for m in model.modules() if units and isinstance(m, units)]
    unit = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    block_params = [p for b in blocks for p in b.parameters()]
    trained_in_blocks = sum(p.numel() for p in block_params if p.requires_grad)
    in_blocks = sum(p.numel() for p in block_params)
    state = "none" if trained_in_blocks == 0 else ("all" if trained_in_blocks == in_blocks else "some")
    return Parameters(total, trained, unit, state)


def settings_of(cfg: DictConfig, recipe, dp_shard: int, tp: int, backend: str, cp: int = 1) -> Settings:
    """The plan's settings from a validated config and the run's resolved mesh and backend."""
    precision = cfg.precision
    param_bytes = DTYPES[str(precision.param_dtype)].itemsize
    autocast = precision.autocast_dtype
    compute_bytes = DTYPES[str(autocast)].itemsize if autocast is not None else param_bytes
    distributed = cfg.distributed
    fsdp2_zero = 3 if distributed.fsdp2.reshard_after_forward else 2
    zero = {"mfsdp": int(distributed.mfsdp.zero_dp_strategy), "fsdp2": fsdp2_zero, "ddp": 0}[backend]
    return Settings(
        backend=backend,
        zero=zero,
        dp_shard=dp_shard,
        tp=tp,
        micro_batch=int(cfg.training.micro_batch_size),
        tokens=int(recipe.tokens_per_sample() or 1),
        activation_checkpointing=bool(cfg.training.activation_checkpointing),
        param_bytes=param_bytes,
        compute_bytes=compute_bytes,
        fp8=bool(precision.fp8.enabled),
        cp=cp,
    )


def advice(
    block: BlockShape,
    params: Parameters,
    s: Settings,
    capacity: float,
    global_batch: int,
    dp_size: int,
    cps: tuple[int, ...] = (),
) -> list[tuple[str, MemoryPlan]]:
    """Up to three settings that would fit `capacity`: a higher ZeRO level (Megatron-FSDP over several ranks), a
    smaller micro-batch that still divides the global batch, activation checkpointing, context parallelism over
    some of the data-parallel ranks (`cps`: the sizes the recipe can split its samples over), and their mixes; those
    without recomputation first, then the fewest changes and the largest micro-batch."""
    zeros = list(range(s.zero, 4)) if s.backend == "mfsdp" and s.dp_shard * s.cp > 1 else [s.zero]
    checkpointing = [s.activation_checkpointing] + ([True] if not s.activation_checkpointing else [])
    found = []
    layouts = [(s.dp_shard, s.cp)] + [(s.dp_shard * s.cp // cp, cp) for cp in cps]
    for ac, (dp_shard, cp), zero in itertools.product(checkpointing, layouts, zeros):
        ranks = dp_size * s.cp // cp  # data-parallel ranks left
        for mb in [b for b in range(s.micro_batch, 0, -1) if global_batch % (b * ranks) == 0]:
            candidate = replace(s, zero=zero, micro_batch=mb, activation_checkpointing=ac, dp_shard=dp_shard, cp=cp)
            if candidate == s:
                continue
            plan = estimate(block, params, candidate)
            if plan.total <= capacity:
                found.append((_overrides(s, candidate), plan))
    # without recomputation first (it costs about a forward pass), then the fewest changes, the largest micro-batch
    found.sort(
        key=lambda item: (
            item[1].settings.activation_checkpointing,
            item[0].count(" "),
            -item[1].settings.micro_batch,
            item[1].total,
        )
    )
    return found[:3]


def _overrides(before: Settings, after: Settings) -> str:
    changes = []
    if after.cp != before.cp:
        changes.append(f"distributed.cp={after.cp}")
    if after.zero != before.zero:
        changes.append(f"distributed.mfsdp.zero_dp_strategy={after.zero}")
    if after.micro_batch != before.micro_batch:
        changes.append(f"training.micro_batch_size={after.micro_batch}")
    if after.activation_checkpointing != before.activation_checkpointing:
        changes.append("training.activation_checkpointing=true")
    return " ".join(changes)


def check(plan: MemoryPlan, capacity: float, suggestions: list[tuple[str, MemoryPlan]], mode: str) -> Optional[str]:
    """ConfigError when the plan exceeds `capacity` (mode "refuse"), naming settings that would fit; a warning line
    (returned) when it comes close or does not fit in mode "warn"; None otherwise."""
    if plan.total <= WARN_SHARE * capacity:
        return None
    if plan.total <= capacity:
        return (
            f"memory plan: ~{plan.total / GIB:.1f} GiB of {capacity / GIB:.1f} GiB per GPU: little room left for "
            'fragmentation (docs/performance.md "Memory plan")'
        )
    if suggestions:
        fix = "; or ".join(f"set {overrides}: ~{p.total / GIB:.1f} GiB" for overrides, p in suggestions)
    else:
        fix = (
            "nothing fits at this size even with ZeRO-3, micro-batch 1 and activation checkpointing: use more GPUs "
            "(distributed.dp_shard) or tensor parallelism (distributed.tp)"
        )
    message = (
        f"training needs ~{plan.total / GIB:.1f} GiB per GPU and the GPU has {capacity / GIB:.1f} GiB "
        f"({', '.join(f'{k} {v / GIB:.1f}' for k, v in plan.parts.items() if v)}): {fix} "
        "(training.memory_plan=warn runs it anyway)"
    )
    if mode == "refuse":
        raise ConfigError(message)
    return message


def plan_for_run(
    cfg: DictConfig,
    recipe,
    dp_shard: int,
    dp_size: int,
    tp: int,
    backend: str,
    capacity: Optional[float],
    cp: int = 1,
):
    """(plan, advice) for a run about to be built; None where the recipe gives no block shape."""
    block = recipe.block_shape()
    if block is None:
        return None
    params = count_parameters(recipe, cfg)
    s = settings_of(cfg, recipe, dp_shard, tp, backend, cp)
    plan = estimate(block, params, s)
    if capacity is None or plan.total <= capacity:
        return plan, []
    batch = int(cfg.training.global_batch_size)
    suggestions = advice(block, params, s, capacity, batch, dp_size, _context_parallel_sizes(recipe, s))
    if int(cfg.distributed.dp_shard) != -1:  # a mesh given in full: context parallelism takes dp_shard's ranks
        suggestions = [
            (o + (f" distributed.dp_shard={p.settings.dp_shard}" if p.settings.cp != s.cp else ""), p)
            for o, p in suggestions
        ]
    return plan, suggestions


def _context_parallel_sizes(recipe, s: Settings) -> tuple[int, ...]:
    """The larger context-parallel sizes this run's ranks allow (cp x a divisor of dp_shard) that the recipe can
    split its samples over (Recipe.check_context_parallel)."""
    sizes = []
    for k in range(2, s.dp_shard + 1):
        if s.dp_shard % k:
            continue
        try:
            recipe.check_context_parallel(s.cp * k)
        except ConfigError:
            continue
        sizes.append(s.cp * k)
    return tuple(sizes)


def check_run(cfg: DictConfig, recipe, env, runtime, log) -> None:
    """train.py's check before building the model (GPUs only): the plan logged on the main rank; ConfigError on every
    rank when it cannot fit (training.memory_plan=refuse), a warning when it comes close."""
    mode = str(cfg.training.memory_plan)
    if mode == "off" or runtime.device_type != "cuda":
        return
    capacity = float(torch.cuda.get_device_properties(env.device).total_memory)
    try:
        result = plan_for_run(
            cfg, recipe, env.dp_shard, env.dp_size, env.tp, str(runtime.parallel), capacity, cp=env.cp
        )
    except Exception as e:  # the plan advises: a model it cannot take apart still trains, unplanned
        if env.is_main:
            log.warning("memory plan: not estimated (%s: %s)", type(e).__name__, e)
        return
    if result is None:
        return
    plan, suggestions = result
    if env.is_main:
        log.info("%s", "\n".join(plan.lines(capacity)))
    line = check(plan, capacity, suggestions, mode)
    if line and env.is_main:
        log.warning("%s", line)
