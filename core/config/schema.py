"""Config schemas: one dataclass per config group. Every default and its meaning lives here once.

`configs/train_defaults.yaml` starts with `base_train` (`TrainConfig` below), so Hydra rejects an unknown
key, a value of the wrong type or a value outside a closed set (the `StrEnum` fields, which list their
choices) while composing, before any work. The YAML files under `configs/` hold only the choices that
differ from these defaults. The `model` and `data` groups belong to a recipe (`recipes/<name>/config.py`);
`validation.validate` checks them against the recipe's schemas, then the values a type alone cannot
judge: each schema's `RANGES` table gives every numeric field its valid range (`core/config/ranges.py`),
and its `check` method what relates several fields or is not a number.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, ClassVar, Optional

from omegaconf import MISSING, OmegaConf

from core.config.errors import require
from core.config.import_path import split_target
from core.config.ranges import EPSILON_MIN, INT32_MAX, Int, Numbers, Real, Rule


class ParallelBackend(StrEnum):
    auto = "auto"  # mfsdp on CUDA, fsdp2 on CPU
    mfsdp = "mfsdp"  # Megatron-FSDP (CUDA only)
    fsdp2 = "fsdp2"  # torch.distributed.fsdp.fully_shard
    ddp = "ddp"  # torch DistributedDataParallel


class LayerBackend(StrEnum):
    auto = "auto"  # te on CUDA when TransformerEngine is installed, torch otherwise
    te = "te"  # transformer_engine.pytorch (CUDA only; FP8 capable)
    torch = "torch"  # core/layers/torch_twins.py: any device, the same parameter names and numerics


class DType(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class ZeroStrategy(IntEnum):
    """What Megatron-FSDP shards over the data-parallel ranks (also given by number, 0-3)."""

    no_shard = 0
    optim = 1
    optim_grads = 2
    optim_grads_params = 3


class OuterShardingStrategy(IntEnum):
    """HSDP: what is sharded over dp_outer (also given by number, 0-1)."""

    no_shard = 0  # replicate
    optim = 1  # shard the optimizer state there too


class NonFinitePolicy(StrEnum):
    stop = "stop"  # stop the run naming the step (checked at log and save steps), never save it
    skip = "skip"  # skip that optimizer step (one host sync per step to decide)


class MemoryPlanMode(StrEnum):
    refuse = "refuse"  # print the plan; stop before building the model when it cannot fit the GPU, naming what would
    warn = "warn"  # print the plan; only warn when it cannot fit
    off = "off"


class CudaGraphs(StrEnum):
    none = "none"  # every micro-batch launched from Python
    # Each micro-batch's forward and backward replayed as one CUDA graph (core/training/cuda_graphs.py).
    forward_backward = "forward_backward"
    auto = "auto"  # forward_backward where the run allows it (core/runtime.py), else none


class MonitorMode(StrEnum):
    min = "min"
    max = "max"


class OptimizerName(StrEnum):
    adamw = "adamw"


class ScheduleName(StrEnum):
    cosine = "cosine"  # linear warmup, then cosine decay to min_lr_ratio * optim.lr at training.steps
    linear = "linear"  # linear warmup, then linear decay to min_lr_ratio * optim.lr
    constant = "constant"  # linear warmup, then constant
    # warmup-stable-decay: linear warmup, constant, then linear decay to min_lr_ratio * optim.lr over the last
    # decay_steps (or decay_fraction of training.steps): a run extended before its decay starts goes on unchanged.
    wsd = "wsd"


class ScheduleExtension(StrEnum):
    """What a resumed run given more (or fewer) training.steps than its schedule spans does with the schedule."""

    # The schedule spans the new training.steps: from the resumed step on, the learning rate is the longer schedule's
    # (a finished cosine or linear decay rises again; a wsd run still in its stable phase goes on unchanged).
    stretch = "stretch"
    # The schedule keeps the length it started with (recorded in the checkpoint): steps past its end keep its final
    # learning rate, min_lr_ratio * optim.lr.
    hold = "hold"


class FP8RecipeName(StrEnum):
    delayed = "delayed"  # scales from an amax history (Hopper+)
    current = "current"  # per-tensor, just-in-time scaling (Hopper+)
    block = "block"  # 1x128 blocks (Hopper, CUDA >= 12.9)
    mxfp8 = "mxfp8"  # Blackwell


class FP8Format(StrEnum):
    hybrid = "hybrid"  # E4M3 forward, E5M2 gradients
    e4m3 = "e4m3"


class AmaxComputeAlgo(StrEnum):
    max = "max"
    most_recent = "most_recent"


class ProgressBar(StrEnum):
    auto = "auto"  # on rank 0 in an interactive terminal
    always = "always"
    never = "never"


class WandbMode(StrEnum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class FinetuneMode(StrEnum):
    """Which weights a run trains (core/training/finetune.py)."""

    full = "full"  # every weight (pretraining, full fine-tuning)
    frozen = "frozen"  # only finetune.head: no backward through the rest
    lora = "lora"  # finetune.head and LoRA adapters; the rest frozen, stored in the forward's compute dtype


class Direction(StrEnum):
    minimize = "minimize"
    maximize = "maximize"


@dataclass
class ObjectiveConfig:
    """What train.py returns to a Hydra sweeper (hydra/sweeper=optuna): the run's last value of `metric`,
    train/<name> (of the last logged step) or val/<name> (of the last validation)."""

    metric: str = "val/loss"
    direction: Direction = Direction.minimize  # what the sweeper does with it

    @staticmethod
    def check(c, key: str) -> None:
        require(
            str(c.metric).startswith(("train/", "val/")),
            f"{key}.metric={c.metric}: expected train/<name> or val/<name> (e.g. val/loss, val/top1, train/loss)",
        )


@dataclass
class ProfileConfig:
    """torch.profiler over a few optimizer steps (core/metrics/profiling.py): a trace and a summary per rank
    under <run dir>/profile/."""

    enabled: bool = False
    start_step: int = 10  # first recorded step (counted like the loop's steps, from 1)
    steps: int = 3
    record_shapes: bool = False
    with_stack: bool = False

    RANGES: ClassVar[dict[str, Rule]] = {"start_step": Int(1, INT32_MAX), "steps": Int(1, INT32_MAX)}


@dataclass
class TrainingConfig:
    # The run's length: optimizer steps, or passes over the training set (steps worked out from its size and
    # the global batch, core/training/length.py). Give one: a config that sets steps takes
    # `training.steps=null training.epochs=N`.
    steps: Optional[int] = None
    epochs: Optional[int] = None
    micro_batch_size: int = MISSING  # samples per forward pass on one rank
    # Samples per optimizer step over all data-parallel ranks. Gradient accumulation steps follow:
    # global_batch_size / (micro_batch_size * data-parallel size), an error if it does not divide.
    global_batch_size: int = MISSING
    val_every_n_steps: int = 0  # 0: validate only at the end
    val_every_n_epochs: int = 0  # also validate at the end of every n-th epoch (0: not by epoch)
    limit_val_batches: int = -1  # per rank; -1: the whole validation set
    log_every_n_steps: int = 10
    val_at_end: bool = True
    # Log the seconds per step spent in forward+backward, gradient sync + clipping and the optimizer
    # step (synchronises the GPU at those boundaries: for benchmarks).
    time_phases: bool = False
    # Recompute each transformer block's activations in the backward pass instead of keeping them
    # (core/parallel/activation_checkpointing.py): less memory, about one more forward pass of compute.
    activation_checkpointing: bool = False
    # Per-GPU memory estimated from the settings before the model is built (core/training/memory_plan.py).
    memory_plan: MemoryPlanMode = MemoryPlanMode.refuse
    # torch.compile each transformer block's forward (core/parallel/compilation.py): fuses the elementwise
    # work of plain-torch blocks; TE blocks keep their own kernels (TE code is not traced).
    compile: bool = False
    # forward_backward: capture one micro-batch's forward and backward as a CUDA graph after two eager
    # micro-batches and replay it, so the GPU no longer waits for Python to launch each kernel (one GPU,
    # Megatron-FSDP; core/training/cuda_graphs.py says what it covers, core/runtime.py what it refuses).
    # auto: forward_backward where the run allows it, none elsewhere.
    cuda_graphs: CudaGraphs = CudaGraphs.none
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # A NaN/Inf loss or gradient norm: stop the run, or skip that optimizer step.
    on_nonfinite: NonFinitePolicy = NonFinitePolicy.stop
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # Observers of the run, called at each step's end, validation and save (docs/callbacks.md): import paths of
    # core.training.callbacks.Callback classes, or mappings {_target_: <import path>, <argument>: <value>, ...}.
    callbacks: list[Any] = field(default_factory=list)

    RANGES: ClassVar[dict[str, Rule]] = {
        "steps": Int(1, INT32_MAX),
        "epochs": Int(1, INT32_MAX),
        "micro_batch_size": Int(1, INT32_MAX),
        "global_batch_size": Int(1, INT32_MAX),
        "val_every_n_steps": Int(0, INT32_MAX, note="0: only at the end"),
        "val_every_n_epochs": Int(0, INT32_MAX, note="0: not by epoch"),
        "limit_val_batches": Int(-1, INT32_MAX, note="-1: the whole validation set, 0: none"),
        "log_every_n_steps": Int(1, INT32_MAX),
    }

    @staticmethod
    def check(c, key: str) -> None:
        require(
            c.steps is None or c.epochs is None,
            f"{key}.steps={c.steps} and {key}.epochs={c.epochs} both give the run's length: give one "
            f"({key}.steps=null {key}.epochs={c.epochs} to train by epochs)",
        )
        require(c.steps is not None or c.epochs is not None, f"{key}.steps or {key}.epochs: give one")
        for i, entry in enumerate(OmegaConf.to_container(c.callbacks, resolve=True)):  # each can be imported
            split_target(entry, f"{key}.callbacks[{i}]")


@dataclass
class MFSDPConfig:
    """Arguments of megatron_fsdp.fully_shard_model, one to one (except te_fuse_wgrad_accumulation)."""

    zero_dp_strategy: ZeroStrategy = ZeroStrategy.optim_grads_params
    outer_dp_sharding_strategy: OuterShardingStrategy = OuterShardingStrategy.no_shard
    # Module classes (import paths) that Megatron-FSDP gathers and frees as one unit.
    # null: the recipe's transformer block class for the chosen layer backend.
    fsdp_unit_modules: Optional[list[str]] = None
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    # False: reduce gradients once per optimizer step (the loop runs no_sync on the other micro-batches).
    # True accumulates wrongly with ZeRO-1 and gradient accumulation (core/parallel/mfsdp.py).
    sync_model_each_microbatch: bool = False
    average_in_collective: bool = False
    disable_bucketing: bool = False
    init_model_with_meta_device: bool = False
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    # Must stay true: checkpoints (and full weights) need the offsets of the uneven shards it provides.
    preproc_state_dict_for_dcp_ckpt: bool = True
    report_nan_in_param_grad: bool = False
    # MixedPrecisionPolicy: dtype of the optimizer's main weights, of the main gradients and of
    # gradient communication (null: follow main_grads_dtype).
    main_params_dtype: DType = DType.fp32
    main_grads_dtype: DType = DType.fp32
    grad_comm_dtype: Optional[DType] = None
    # TE layers write weight gradients into these main gradients from their wgrad GEMMs (TE's
    # fuse_wgrad_accumulation); switched off where it would lose accumulated gradients (ZeRO-1, and
    # ZeRO-2/3 over one dp_shard rank: core/parallel/mfsdp.py); no effect on torch layers.
    te_fuse_wgrad_accumulation: bool = True

    @staticmethod
    def check(c, key: str) -> None:
        require(
            c.preproc_state_dict_for_dcp_ckpt,
            f"{key}.preproc_state_dict_for_dcp_ckpt=false: checkpoints (and full weights for tests) need the "
            "offsets of Megatron-FSDP's uneven shards that it provides; keep it true",
        )


@dataclass
class FSDP2Config:
    """Arguments of torch.distributed.fsdp.fully_shard."""

    reshard_after_forward: bool = True  # ZeRO-3 (true) or ZeRO-2-like (false)
    # null: the recipe's transformer block class for the chosen layer backend.
    fsdp_unit_modules: Optional[list[str]] = None
    reduce_dtype: DType = DType.fp32  # gradient reduce-scatter dtype (compute dtype: precision.param_dtype)


@dataclass
class DDPConfig:
    """Arguments of torch.nn.parallel.DistributedDataParallel."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    find_unused_parameters: bool = False
    static_graph: bool = False

    # DDP turns the size into a byte count; 1 TiB is more than any device holds.
    RANGES: ClassVar[dict[str, Rule]] = {"bucket_cap_mb": Real(0, 1024 * 1024, open_low=True)}


@dataclass
class DistributedConfig:
    backend: ParallelBackend = ParallelBackend.auto
    # Device mesh: dp_outer x dp_shard x cp x tp must equal the world size; -1 = what is left.
    dp_shard: int = -1
    dp_outer: int = 1  # > 1: hybrid sharding (HSDP), replicas over dp_outer
    tp: int = 1  # tensor-parallel size (the GPT recipe): attention heads and MLP split over tp ranks
    # Context-parallel size (the GPT and ESM-2 recipes): each sequence's tokens split over cp ranks, which attend over
    # each other's keys and values (core/layers/context_parallel.py); the weights are sharded over dp_shard x cp.
    cp: int = 1
    timeout_minutes: float = 30.0
    # Each backend's own settings; the one that `backend` picks is used.
    mfsdp: MFSDPConfig = field(default_factory=MFSDPConfig)
    fsdp2: FSDP2Config = field(default_factory=FSDP2Config)
    ddp: DDPConfig = field(default_factory=DDPConfig)

    # The mesh sizes are checked against the world size at start-up.
    RANGES: ClassVar[dict[str, Rule]] = {
        "dp_shard": Int(1, INT32_MAX, also=-1, note="-1: what is left"),
        "dp_outer": Int(1, INT32_MAX),
        "tp": Int(1, INT32_MAX),
        "cp": Int(1, INT32_MAX),
        # A week: a collective that waits longer has hung; datetime.timedelta overflows far above. Below 6 s,
        # ranks that start a moment apart time out at start-up (1e-300: "timed out after 0ms").
        "timeout_minutes": Real(0.1, 7 * 24 * 60),
    }


# Signals a run cannot save on, and why (refused by CheckpointConfig.check before any work).
_FAULT = (
    "a fault of the process's own code: Python's handler returns to the faulting instruction, which faults "
    "again, so the crash becomes a hang"
)
UNFIT_SIGNALS = {
    "SIGKILL": "cannot be caught",
    "SIGSTOP": "cannot be caught",
    "SIGCHLD": "sent whenever a child process ends (a loader or compile worker), not a request to stop",
    "SIGSEGV": _FAULT,
    "SIGBUS": _FAULT,
    "SIGFPE": _FAULT,
    "SIGILL": _FAULT,
}


@dataclass
class CheckpointConfig:
    """Torch DCP checkpoints in <path>/step_<N>/ (core/checkpointing/)."""

    # The default is the same for every run of a command (outputs/<config>/checkpoints; a command line that changes
    # what is trained or the parallel layout: outputs/<config>/<those overrides>/checkpoints, core/distributed/
    # launch.py), so running the same command again resumes; in a multirun sweep,
    # <sweep dir>/checkpoints/<the job's overrides>, so a sweep run again resumes each configuration's own job.
    # A path given to a multirun is the root instead: <path>/<the job's overrides>.
    path: str = "${checkpoint_dir:}"
    save_every_n_steps: int = 0  # 0: only the final save
    save_every_n_epochs: int = 0  # also save at the end of every n-th epoch (0: not by epoch)
    save_final: bool = True
    # auto: continue from the newest complete checkpoint under `path` if there is one;
    # true: the same, but it is an error if there is none; false: start fresh;
    # <step dir>: continue from that checkpoint (an error if it is missing or incomplete).
    resume: Any = "auto"
    # A resume whose model, data, optimizer, schedule, seed, global batch, precision or finetune settings differ from
    # the checkpoint's stops before any work, listing them; true: continue with the new values on purpose.
    allow_config_changes: bool = False
    # Check every file against the CRC-32 recorded when it was written before loading it (resume and
    # init_from); a damaged newest checkpoint is skipped by automatic resume, an explicit one is an error.
    verify_checksums: bool = True
    overwrite: bool = False  # with resume=false: delete the step folders already under `path`
    keep_last_n: int = -1  # -1: keep all
    keep_every_n_steps: int = 0  # also keep every checkpoint whose step is a multiple (0: none)
    monitor: Optional[str] = None  # e.g. val/loss, val/top1, train/loss: rank checkpoints by this metric...
    monitor_mode: MonitorMode = MonitorMode.min  # ... lower (min) or higher (max) is better ...
    keep_best_k: int = 0  # ... and keep the best k of them (0: none)
    # Write in a background thread (torch DCP async_save); the loop stalls only to copy to host memory;
    # at most one save in flight.
    async_save: bool = False
    # Files each rank writes in parallel (DCP's writer threads); checksums are computed in the same threads.
    write_threads: int = 8
    # Save and stop at the end of the current step when one of these signals arrives: SIGTERM (torchrun passes
    # it on), SIGUSR1/SIGUSR2 (a scheduler's warning before the time limit; hydra-submitit-launcher's is SIGUSR2).
    save_on_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGUSR2"])
    # Start from another run's weights only (fresh optimizer, step 0): a step dir, .pt or .safetensors.
    init_from: Optional[str] = None
    init_skip_prefixes: list[str] = field(default_factory=list)  # e.g. [head]: keep the new init there
    # Weights in the source that this model does not have (e.g. a pretraining head): an error (false),
    # or listed in the log and not used (true). Missing weights are always an error.
    init_ignore_unexpected: bool = False

    RANGES: ClassVar[dict[str, Rule]] = {
        "save_every_n_steps": Int(0, INT32_MAX, note="0: only the final save"),
        "save_every_n_epochs": Int(0, INT32_MAX, note="0: not by epoch"),
        "keep_last_n": Int(1, INT32_MAX, also=-1, note="-1: keep all; never 0: a resume needs the newest"),
        "keep_every_n_steps": Int(0, INT32_MAX, note="0: none"),
        "keep_best_k": Int(0, INT32_MAX, note="0: none"),
        "write_threads": Int(1, 1024),  # threads per rank: beyond a thousand, a typo
    }

    @staticmethod
    def check(c, key: str) -> None:
        require(not (c.keep_best_k > 0 and not c.monitor), f"{key}.keep_best_k needs {key}.monitor (e.g. val/loss)")
        require(
            not c.monitor or str(c.monitor).startswith(("train/", "val/")),
            f"{key}.monitor={c.monitor}: expected train/<name> or val/<name> (e.g. val/loss, train/loss)",
        )
        for name in c.save_on_signals:
            sig = getattr(signal.Signals, str(name).upper(), None)
            require(
                isinstance(sig, signal.Signals),
                f"{key}.save_on_signals: unknown signal {name!r} (e.g. SIGTERM, SIGUSR1)",
            )
            require(
                sig.name not in UNFIT_SIGNALS,
                f"{key}.save_on_signals: {name}: {UNFIT_SIGNALS.get(sig.name)}; save on a request to stop "
                "(e.g. SIGTERM, SIGUSR1)",
            )
        require(
            isinstance(c.resume, (bool, str)), f"{key}.resume={c.resume!r}: expected auto, true, false or a step folder"
        )


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-3
    weight_decay: float = 0.05  # not applied to biases, norm weights or the recipe's exceptions
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping (the norm is still logged)
    # null: the fused kernel on CUDA, torch's default (foreach) on CPU.
    fused: Optional[bool] = None

    RANGES: ClassVar[dict[str, Rule]] = {
        # AdamW's steps are about lr in size: above 10 nothing trains. 1e-30, far below any weight's last bit, is
        # a step that leaves the weights as they are (the tests' "load, step, compare"); below it the step nears
        # fp32's denormals, and a denormal lr is 0 in fp32.
        "lr": Real(1e-30, 10),
        "weight_decay": Real(0, 10),  # decoupled: each step scales the weights by 1 - lr * weight_decay
        "betas": Numbers(Real(0, 1, open_high=True), length=2),  # the moving averages' decay
        "eps": Real(EPSILON_MIN, 1),  # added to the gradient's root mean square, which is 0 for a zero gradient
        # A gradient norm above the upper bound means the run has diverged; 0 switches clipping off.
        "max_grad_norm": Real(0, 1e6, note="0: no clipping"),
    }


@dataclass
class SchedulerConfig:
    name: ScheduleName = ScheduleName.cosine
    warmup_steps: int = 0  # linear warmup from 0 over these steps
    min_lr_ratio: float = 0.0  # final lr = min_lr_ratio * optim.lr (constant: the lr stays)
    decay_fraction: float = 0.2  # wsd: the decay spans this share of the schedule's steps, at its end ...
    decay_steps: Optional[int] = None  # ... or this many steps (null: decay_fraction)
    # A resumed run whose training.steps differ from the length its schedule started with (extended): stretch the
    # schedule over the new length, or hold it (ScheduleExtension). Changing it does not make another run.
    on_extend: ScheduleExtension = ScheduleExtension.stretch

    RANGES: ClassVar[dict[str, Rule]] = {
        "warmup_steps": Int(0, INT32_MAX),
        "min_lr_ratio": Real(0, 1),
        "decay_fraction": Real(0, 1),
        "decay_steps": Int(0, INT32_MAX),
    }


@dataclass
class FP8Config:
    """TransformerEngine FP8 (model.backend=te on Hopper or newer)."""

    enabled: bool = False
    recipe: FP8RecipeName = FP8RecipeName.delayed
    fp8_format: FP8Format = FP8Format.hybrid
    amax_history_len: int = 1024  # delayed scaling only
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.max  # delayed scaling only
    margin: int = 0  # delayed scaling only

    RANGES: ClassVar[dict[str, Rule]] = {
        "amax_history_len": Int(1, INT32_MAX),
        "margin": Int(0, 127),  # the scale is divided by 2**margin, a finite fp32 number up to 2**127
    }


@dataclass
class PrecisionConfig:
    # torch.autocast dtype of the forward pass (null: none, fp32 compute).
    autocast_dtype: Optional[DType] = DType.bf16
    # dtype of the weights used in compute (fsdp2's param_dtype; mfsdp and ddp cast the model). mfsdp and
    # fsdp2 keep fp32 master weights for the optimizer and checkpoints; ddp refuses anything but fp32.
    param_dtype: DType = DType.fp32
    fp8: FP8Config = field(default_factory=FP8Config)


@dataclass
class LoraConfig:
    """LoRA adapters (core/layers/lora.py): on each target module, update = (alpha / rank) * x A^T B^T."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapters' input
    # Modules by the last part of their name: TE's (and the twins') attention input projection and output projection.
    # Linear and LayerNormLinear layers only (LayerNormMLP's fc1/fc2 are fused inside one module).
    target_modules: list[str] = field(default_factory=lambda: ["layernorm_qkv", "proj"])

    RANGES: ClassVar[dict[str, Rule]] = {
        "rank": Int(1, 65536),
        "alpha": Real(0, 1e6, open_low=True),
        "dropout": Real(0, 1, open_high=True),
    }

    @staticmethod
    def check(c, key: str) -> None:
        require(len(c.target_modules) > 0, f"{key}.target_modules is empty: name the modules to adapt (e.g. proj)")


@dataclass
class FinetuneConfig:
    """Fine-tuning (core/training/finetune.py): which weights train, and their learning rates. The defaults train
    everything at optim.lr, as pretraining does."""

    mode: FinetuneMode = FinetuneMode.full
    # Module prefixes that are the task head: trained in every mode at optim.lr; checkpoint.init_from may lack them
    # (they keep their fresh init).
    head: list[str] = field(default_factory=lambda: ["head"])
    backbone_lr_scale: float = 1.0  # every trainable non-head weight's lr = optim.lr * this ...
    # ... * layer_decay ** (L - i) in block i of L (0-based), ** (L + 1) before the first block (embeddings). 1: off.
    layer_decay: float = 1.0
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Module prefixes kept frozen in every mode, over the head and LoRA (e.g. [embedding]: frozen embeddings).
    frozen: list[str] = field(default_factory=list)

    RANGES: ClassVar[dict[str, Rule]] = {
        "backbone_lr_scale": Real(0, 1000, note="0: the backbone's weights stay put (finetune.mode=frozen skips them)"),
        "layer_decay": Real(0, 1, open_low=True, note="1: off"),
    }

    @staticmethod
    def check(c, key: str) -> None:
        for prefix in c.head:
            require(bool(str(prefix).strip(".")), f"{key}.head: {prefix!r} is not a module prefix (e.g. head)")
        for prefix in c.frozen:
            require(bool(str(prefix).strip(".")), f"{key}.frozen: {prefix!r} is not a module prefix (e.g. embedding)")
        require(  # lora trains its adapters with or without a head (a language model's SFT keeps its output layer)
            c.mode != FinetuneMode.frozen or len(c.head) > 0,
            f"{key}.mode={c.mode} trains {key}.head, which is empty: name the head's module (e.g. [head])",
        )


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "recipes"
    entity: Optional[str] = None
    name: Optional[str] = None  # null: the run directory's name
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    mode: Optional[WandbMode] = None  # null: WANDB_MODE, or online


@dataclass
class TensorBoardConfig:
    enabled: bool = False  # event files in <run dir>/tensorboard: `tensorboard --logdir <run dir>`


@dataclass
class LoggerConfig:
    stdout: bool = True
    jsonl: bool = True  # <run dir>/metrics.jsonl, one JSON object per logged step, validation and save
    progress_bar: ProgressBar = ProgressBar.auto
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)


@dataclass
class PredictConfig:
    """predict.py: run the model of `checkpoint.init_from` over one split, one output row per sample."""

    # Which of the recipe's splits (e.g. test | val); null: the data's test split where it has one, else val
    # (the log says which).
    split: Optional[str] = None
    folder: Optional[str] = None  # instead of a split: every input under this folder, unlabeled (the ViT)
    micro_batch_size: int = 256  # per rank
    output: Optional[str] = None  # a .csv file; null: <run dir>/predictions.csv
    # Recipes that write embeddings (ESM-2): the hidden states after this many blocks, averaged over each
    # sequence's residues; null: after the last block and the final norm.
    embedding_layer: Optional[int] = None

    RANGES: ClassVar[dict[str, Rule]] = {
        "micro_batch_size": Int(1, INT32_MAX),
        "embedding_layer": Int(0, INT32_MAX, note="0: the token embeddings"),
    }


@dataclass
class GenerateConfig:
    """generate.py: continue prompts with the language model of `checkpoint.init_from` (GPT recipe)."""

    prompt: Optional[str] = None  # one prompt
    prompt_file: Optional[str] = None  # one prompt per line; .jsonl: a "prompt" text or a chat's "messages" per line
    chat: bool = False  # each text prompt as the one user message of a chat (rendered by the chat template)
    max_new_tokens: int = 200  # per prompt (the model sees the last model.seq_length tokens at most)
    greedy: bool = False  # the most likely token each time (temperature, top_k, top_p unused)
    temperature: float = 1.0  # sampling: logits / temperature
    top_k: int = 0  # sampling: only the k most likely tokens (0: all)
    top_p: float = 1.0  # sampling: only the most likely tokens whose probabilities add up to top_p
    samples_per_prompt: int = 1
    seed: int = 0  # sample j of prompt i draws from (seed, i, j): the same seed gives the same text
    stop_at_eod: bool = True  # end a continuation at the end-of-document token (a chat's reply: also at end of turn)
    stream: bool = True  # print each new token's text as it comes (else each continuation once done)
    kv_cache: bool = True  # false: recompute the whole sequence for every token (a reference)
    # A .jsonl file, appended to as each continuation is done; one that exists is continued after its last line
    # (when made with the same settings: docs/gpt.md). null: <run dir>/generations.jsonl
    output: Optional[str] = None

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_new_tokens": Int(1, INT32_MAX),
        # logits / temperature must stay finite, and lower ones pick the most likely token anyway; above
        # the upper bound sampling is close to uniform.
        "temperature": Real(0.001, 100, note="for the most likely token: generate.greedy=true"),
        "top_k": Int(0, INT32_MAX, note="0: all"),
        "top_p": Real(0, 1, open_low=True),
        "samples_per_prompt": Int(1, INT32_MAX),
        "seed": Int(0, INT32_MAX),
    }


@dataclass
class ModelConfig:
    """What every recipe's `model` schema has (the recipes' schemas extend it)."""

    backend: LayerBackend = LayerBackend.auto


@dataclass
class DataConfig:
    """What every recipe's `data` schema has (the recipes' schemas extend it)."""

    num_workers: int = 2  # loader worker processes per rank
    pin_memory: bool = True  # page-locked host batches (CUDA only)

    # Processes per rank: beyond a thousand, a typo.
    RANGES: ClassVar[dict[str, Rule]] = {"num_workers": Int(0, 1024, note="0: load in the training process")}


@dataclass
class TrainConfig:
    recipe: str = MISSING  # the name of a recipe: a folder recipes/<name>/ with a recipe.py (recipes/registry.py)
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
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)

    RANGES: ClassVar[dict[str, Rule]] = {"seed": Int(0, INT32_MAX, note="each rank seeds numpy with seed + rank")}
