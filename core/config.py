"""Config schemas: one dataclass per config group, registered in Hydra's ConfigStore.

Top-level YAML files in `configs/` start their defaults list with `base_train` (the `TrainConfig`
schema below), so Hydra rejects an unknown key or a value of the wrong type while composing, before
any work. The `model` and `data` groups belong to a recipe: each recipe registers its own schemas
(see `recipes/<name>/config.py`), and `validate` checks them again after composition, because a
`+key=value` override bypasses Hydra's struct checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class ProfileConfig:
    """torch.profiler over a few optimizer steps (core/profiling.py): a trace and a summary per rank."""
    enabled: bool = False
    start_step: int = 10  # first recorded step (counted like the loop's steps, from 1)
    steps: int = 3
    record_shapes: bool = False
    with_stack: bool = False


@dataclass
class TrainingConfig:
    steps: int = MISSING
    micro_batch_size: int = MISSING
    # Samples per optimizer step over all data-parallel ranks. Gradient accumulation steps follow:
    # global_batch_size / (micro_batch_size * data_parallel_size).
    global_batch_size: int = MISSING
    val_every_n_steps: int = 0  # 0: validate only at the end
    limit_val_batches: int = -1  # per rank; -1: the whole validation set
    log_every_n_steps: int = 10
    val_at_end: bool = True
    # Log the seconds per step spent in forward+backward, gradient sync + clipping and the optimizer
    # step (synchronises the GPU at those boundaries: for benchmarks).
    time_phases: bool = False
    # Recompute each transformer block's activations in the backward pass instead of keeping them
    # (core/activation_checkpointing.py): less memory, about one more forward pass of compute.
    activation_checkpointing: bool = False
    # torch.compile each transformer block's forward (core/compilation.py): fuses the elementwise work
    # of plain-torch blocks; TE blocks keep their own kernels (TE code is not traced).
    compile: bool = False
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # A NaN/Inf loss or gradient norm: "stop" the run naming the step (checked at log and save steps,
    # never saved), or "skip" that optimizer step (costs one host sync per step to decide).
    on_nonfinite: str = "stop"


@dataclass
class MFSDPConfig:
    """Arguments of megatron_fsdp.fully_shard_model (0.6.1), one to one."""

    zero_dp_strategy: int = 3  # 0 no_shard, 1 optim, 2 optim_grads, 3 optim_grads_params
    outer_dp_sharding_strategy: int = 0  # HSDP only: 0 replicate over dp_outer, 1 shard optim
    # Module classes (import paths) that Megatron-FSDP gathers and frees as one unit.
    # null: the recipe's transformer block class for the chosen layer backend.
    fsdp_unit_modules: Optional[list[str]] = None
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    # False: reduce gradients once per optimizer step (we call no_sync on the other micro-batches).
    # True is wrong with ZeRO-1 and gradient accumulation in 0.6.1 (see the shared notes).
    sync_model_each_microbatch: bool = False
    average_in_collective: bool = False
    disable_bucketing: bool = False
    init_model_with_meta_device: bool = False
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    preproc_state_dict_for_dcp_ckpt: bool = True
    report_nan_in_param_grad: bool = False
    # MixedPrecisionPolicy: dtype of the optimizer's main weights, of the main gradients and of
    # gradient communication (null: follow main_grads_dtype).
    main_params_dtype: str = "fp32"
    main_grads_dtype: str = "fp32"
    grad_comm_dtype: Optional[str] = None
    # Not a fully_shard_model argument: TE layers write weight gradients into these main gradients from
    # their wgrad GEMMs (TE's fuse_wgrad_accumulation); off for ZeRO-1 and for ZeRO-2/3 over one dp_shard rank
    # (see core/parallel/mfsdp.py); no effect on torch layers.
    te_fuse_wgrad_accumulation: bool = True


@dataclass
class FSDP2Config:
    """Arguments of torch.distributed.fsdp.fully_shard."""

    reshard_after_forward: bool = True
    # null: the recipe's transformer block class for the chosen layer backend.
    fsdp_unit_modules: Optional[list[str]] = None
    reduce_dtype: str = "fp32"


@dataclass
class DDPConfig:
    """Arguments of torch.nn.parallel.DistributedDataParallel."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    find_unused_parameters: bool = False
    static_graph: bool = False


@dataclass
class DistributedConfig:
    # auto: mfsdp (+ TE layers) on CUDA, fsdp2 (+ plain torch layers) on CPU.
    backend: str = "auto"
    # Device mesh: dp_outer x dp_shard x tp must equal the world size; -1 = what is left.
    dp_shard: int = -1
    dp_outer: int = 1  # > 1: hybrid sharding (HSDP), replicas over dp_outer
    tp: int = 1
    timeout_minutes: float = 30.0
    mfsdp: MFSDPConfig = field(default_factory=MFSDPConfig)
    fsdp2: FSDP2Config = field(default_factory=FSDP2Config)
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class CheckpointConfig:
    """Torch DCP checkpoints in <path>/step_<N>/ (see checkpoint.py)."""

    path: str = MISSING
    save_every_n_steps: int = 0  # 0: only the final save
    save_final: bool = True
    # auto: continue from the newest complete checkpoint under `path` if there is one;
    # true: the same, but it is an error if there is none; false: start fresh;
    # <step dir>: continue from that checkpoint (an error if it is missing or incomplete).
    resume: Any = "auto"
    overwrite: bool = False  # with resume=false: delete the step folders already under `path`
    keep_last_n: int = -1  # -1: keep all
    keep_every_n_steps: int = 0  # also keep every checkpoint whose step is a multiple (0: none)
    monitor: Optional[str] = None  # e.g. val/loss: rank checkpoints by this validation metric...
    monitor_mode: str = "min"  # ... lower (min) or higher (max) is better ...
    keep_best_k: int = 0  # ... and keep the best k of them (0: none)
    # Write in a background thread (torch DCP async_save); at most one save in flight.
    async_save: bool = False
    # Save and stop at the end of the current step when one of these signals arrives.
    save_on_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    # Start from another run's weights only (fresh optimizer, step 0): a step dir, .pt or .safetensors.
    init_from: Optional[str] = None
    init_skip_prefixes: list[str] = field(default_factory=list)  # e.g. [head]: keep the new init there
    # Weights in the source that this model does not have (e.g. a pretraining head): an error (false),
    # or listed in the log and not used (true). Missing weights are always an error.
    init_ignore_unexpected: bool = False


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = MISSING
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping (the norm is still logged)
    # null: fused on CUDA, torch's default (foreach) on CPU.
    fused: Optional[bool] = None


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # final lr = min_lr_ratio * optim.lr


@dataclass
class FP8Config:
    enabled: bool = False
    recipe: str = "delayed"  # delayed | current | block (Hopper); mxfp8 (Blackwell)
    fp8_format: str = "hybrid"  # hybrid (E4M3 forward, E5M2 backward) | e4m3
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0


@dataclass
class PrecisionConfig:
    # torch.autocast dtype for the forward pass (bf16 | fp16 | null for none).
    autocast_dtype: Optional[str] = "bf16"
    # dtype of the weights used in compute (fsdp2 param_dtype; mfsdp and ddp cast the model).
    param_dtype: str = "fp32"
    fp8: FP8Config = field(default_factory=FP8Config)


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "recipes"
    entity: Optional[str] = None
    name: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    mode: Optional[str] = None  # online | offline | disabled; null: WANDB_MODE or online


@dataclass
class LoggerConfig:
    stdout: bool = True
    jsonl: bool = True  # <run dir>/metrics.jsonl
    progress_bar: str = "auto"  # auto: on rank 0 in an interactive terminal | always | never
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class PredictConfig:
    """predict.py: run the model of `checkpoint.init_from` over one split, one output row per sample."""

    split: str = "test"  # which of the recipe's splits (e.g. test | val)
    micro_batch_size: int = 256  # per rank
    output: Optional[str] = None  # a .csv file; null: <run dir>/predictions.csv


@dataclass
class TrainConfig:
    recipe: str = MISSING
    seed: int = 1234
    training: TrainingConfig = field(default_factory=TrainingConfig)
    # Recipe-specific: validated against the recipe's own schemas.
    model: Any = MISSING
    data: Any = MISSING
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (the recipes register theirs on import)."""
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    import recipes  # noqa: F401  (registers each recipe's model/data schemas)


class ConfigError(ValueError):
    """A config value that is well-typed but unusable; the message names the key."""


def validate(cfg: DictConfig) -> DictConfig:
    """Check the composed config against the schemas, strictly, and return it resolved.

    Raises ConfigError naming the offending key (unknown key, wrong type, missing value).
    """
    from recipes import get_recipe

    try:
        recipe = get_recipe(cfg.recipe)
    except KeyError as e:
        raise ConfigError(f"recipe: {e.args[0]}") from None
    schema = OmegaConf.structured(TrainConfig)
    schema.model = OmegaConf.structured(recipe.model_schema)
    schema.data = OmegaConf.structured(recipe.data_schema)
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        checked = OmegaConf.merge(schema, container)
        OmegaConf.to_container(checked, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        message = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"invalid config at '{key}': {message}") from None
    OmegaConf.set_readonly(checked, True)
    return checked
