"""Every decision about devices and backends, made once, before any process group or model exists.

`resolve(cfg, machine)` turns the config's choices into a `Runtime`:
  device_type   cuda when the machine has a GPU, cpu otherwise
  parallel      distributed.backend: auto -> mfsdp on CUDA, fsdp2 on CPU
  layers        model.backend: auto -> te on CUDA with TransformerEngine installed, torch otherwise
  autocast      precision.autocast_dtype; param_dtype, the compute weights' dtype
  fp8_recipe    TransformerEngine's FP8 recipe object (precision.fp8), or None (built at first use)
and refuses the combinations that cannot work, naming the keys. The rest of the code takes these
resolved values (`core.layers.namespace.get_layers` turns `layers` into the layer classes,
`core.parallel.parallelize` turns `parallel` into the wrapper); no other module tests the config's
backend strings.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from core.config.errors import ConfigError
from core.config.schema import CudaGraphs, DType, FP8RecipeName, LayerBackend, ParallelBackend
from core.layers.namespace import te_available
from core.training.precision import DTYPES, fp8_recipe

log = logging.getLogger(__name__)

GRAPHED_FP8_RECIPES = (FP8RecipeName.delayed, FP8RecipeName.current)  # checked against eager runs (GPU tests)


@dataclass(frozen=True)
class Machine:
    """What this process can use."""

    cuda: bool
    te: bool  # TransformerEngine is installed

    @staticmethod
    def detect() -> "Machine":
        return Machine(cuda=torch.cuda.is_available(), te=te_available())


@dataclass(frozen=True)
class Runtime:
    device_type: str  # "cuda" | "cpu"
    parallel: ParallelBackend  # mfsdp | fsdp2 | ddp (never auto)
    layers: LayerBackend  # te | torch (never auto)
    autocast_dtype: Optional[torch.dtype]  # None: no autocast
    param_dtype: torch.dtype
    fp8: Any = None  # precision.fp8 when FP8 is on
    cuda_graphs: bool = False  # micro-batches replayed as CUDA graphs (training.cuda_graphs)
    cuda_graphs_auto: bool = False  # chosen by training.cuda_graphs=auto
    parallel_auto: bool = False  # chosen by `auto` (for the log line)
    layers_auto: bool = False

    def on_mesh(self, cfg: DictConfig, dp_size: int, dp_outer: int, tp: int) -> "Runtime":
        """What still holds once the mesh is known: CUDA graphs on several ranks only where no collective runs
        inside a micro-batch (cuda_graphs_mesh_refusals)."""
        if not self.cuda_graphs:
            return self
        refusals = cuda_graphs_mesh_refusals(cfg, dp_size, dp_outer, tp)
        if not refusals:
            return self
        if not self.cuda_graphs_auto:
            raise ConfigError(
                f"training.cuda_graphs={cfg.training.cuda_graphs} {refusals[0]}; use "
                "training.cuda_graphs=auto (eager where graphs do not apply) or none"
            )
        log.info("training.cuda_graphs=auto: eager micro-batches (a graphed run %s)", refusals[0])
        return replace(self, cuda_graphs=False)

    @functools.cached_property
    def fp8_recipe(self) -> Any:
        """TE's FP8 recipe object, or None. Built at first use, after the process has picked its GPU:
        importing TransformerEngine before that could open a CUDA context on GPU 0 in every process."""
        return fp8_recipe(self.fp8) if self.fp8 is not None else None


CUDA_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def request_cuda_connections(wanted: Optional[int]) -> None:
    """Give this process `wanted` CUDA hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS) before its CUDA
    context exists, which reads the variable once. A value set outside wins; a smaller one, or a context
    already started, is warned about: GPU work on a side stream may then wait behind the step's kernels."""
    if wanted is None:
        return
    main = os.environ.get("RANK", "0") == "0"  # every rank does the same: one says so
    given = os.environ.get(CUDA_CONNECTIONS_ENV)
    if given is not None:
        count = given.strip()
        if main and not (count.isascii() and count.isdigit() and int(count) >= wanted):
            log.warning(
                "%s=%s is set: this run's data work on the GPU wants %d queues and may wait behind the step's "
                'kernels (docs/performance.md, "Real JPEGs while training")',
                CUDA_CONNECTIONS_ENV,
                given,
                wanted,
            )
        return
    if torch.cuda.is_initialized():
        if main:
            log.warning(
                "CUDA started before %s could be set to %d: the driver's default applies", CUDA_CONNECTIONS_ENV, wanted
            )
        return
    os.environ[CUDA_CONNECTIONS_ENV] = str(wanted)
    if main:
        log.info("%s=%d: the recipe queues GPU work beside the step", CUDA_CONNECTIONS_ENV, wanted)


def resolve_parallel_backend(backend: ParallelBackend, machine: Machine) -> ParallelBackend:
    if backend == ParallelBackend.auto:
        return ParallelBackend.mfsdp if machine.cuda else ParallelBackend.fsdp2
    if backend == ParallelBackend.mfsdp and not machine.cuda:
        raise ConfigError(
            "distributed.backend=mfsdp needs CUDA GPUs (Megatron-FSDP is CUDA-only); use fsdp2 or ddp on CPU"
        )
    return ParallelBackend(backend)


def resolve_layer_backend(backend: LayerBackend, machine: Machine) -> LayerBackend:
    if backend == LayerBackend.auto:
        if machine.cuda and machine.te:
            return LayerBackend.te
        if machine.cuda:
            log.warning(
                "TransformerEngine is not installed: using plain torch layers "
                "(pip install transformer-engine[pytorch], or the NGC PyTorch container)"
            )
        return LayerBackend.torch
    if backend == LayerBackend.te:
        if not machine.cuda:
            raise ConfigError("model.backend=te needs a CUDA device; use model.backend=torch (or auto) on CPU")
        if not machine.te:
            raise ConfigError(
                "model.backend=te but TransformerEngine is not installed (pip install transformer-engine[pytorch])"
            )
    return LayerBackend(backend)


def resolve(cfg: DictConfig, machine: Optional[Machine] = None) -> Runtime:
    """The runtime of a validated config on this machine; a ConfigError for what cannot run here."""
    machine = machine or Machine.detect()
    parallel = resolve_parallel_backend(cfg.distributed.backend, machine)
    layers = resolve_layer_backend(cfg.model.backend, machine)
    precision, tp = cfg.precision, cfg.distributed.tp
    if parallel == ParallelBackend.ddp and precision.param_dtype != DType.fp32:
        raise ConfigError(
            f"distributed.backend=ddp with precision.param_dtype={precision.param_dtype}: DDP would "
            "train the weights themselves in that dtype, with no fp32 master copy; use "
            "precision.param_dtype=fp32 with ddp, or mfsdp / fsdp2, which keep fp32 master weights"
        )
    if tp > 1 and parallel == ParallelBackend.ddp:
        raise ConfigError("distributed.tp > 1 needs distributed.backend=mfsdp or fsdp2 (ddp keeps whole replicas)")
    if tp > 1 and parallel == ParallelBackend.fsdp2 and layers == LayerBackend.te:
        raise ConfigError(
            "distributed.tp > 1 with distributed.backend=fsdp2 needs model.backend=torch; "
            "TE layers are tensor-parallel under distributed.backend=mfsdp"
        )
    attention_dtype = precision.autocast_dtype or precision.param_dtype
    if cfg.distributed.cp > 1 and layers == LayerBackend.te and attention_dtype == DType.fp32:
        raise ConfigError(
            f"distributed.cp={cfg.distributed.cp} with fp32 attention on TransformerEngine layers: TE's "
            "context-parallel attention (flash or fused) is 16-bit; set precision=bf16 (or "
            "precision.autocast_dtype=bf16)"
        )
    if precision.fp8.enabled and layers != LayerBackend.te:
        raise ConfigError("precision.fp8.enabled needs TransformerEngine layers (model.backend=te on a CUDA GPU)")
    graphs = cfg.training.cuda_graphs == CudaGraphs.forward_backward
    if graphs:
        check_cuda_graphs(cfg, machine, parallel)
    elif cfg.training.cuda_graphs == CudaGraphs.auto:
        graphs = not cuda_graphs_refusals(cfg, machine, parallel)
    autocast = DTYPES[precision.autocast_dtype] if precision.autocast_dtype is not None else None
    return Runtime(
        device_type="cuda" if machine.cuda else "cpu",
        parallel=parallel,
        layers=layers,
        autocast_dtype=autocast,
        param_dtype=DTYPES[precision.param_dtype],
        fp8=precision.fp8 if precision.fp8.enabled else None,
        cuda_graphs=graphs,
        cuda_graphs_auto=cfg.training.cuda_graphs == CudaGraphs.auto,
        parallel_auto=cfg.distributed.backend == ParallelBackend.auto,
        layers_auto=cfg.model.backend == LayerBackend.auto,
    )


def check_cuda_graphs(cfg: DictConfig, machine: Machine, parallel: ParallelBackend) -> None:
    """training.cuda_graphs=forward_backward is refused before any work where it would not run, or would not
    be checked against the eager loop (core/training/cuda_graphs.py)."""
    refusals = cuda_graphs_refusals(cfg, machine, parallel)
    if refusals:
        raise ConfigError(f"training.cuda_graphs={cfg.training.cuda_graphs} {refusals[0]}")


def cuda_graphs_refusals(cfg: DictConfig, machine: Machine, parallel: ParallelBackend) -> list[str]:
    """Why this config cannot replay its micro-batches as CUDA graphs ([] if it can)."""
    training = cfg.training
    refusals = [
        (not machine.cuda, "needs a CUDA GPU (CUDA graphs are a GPU feature); use training.cuda_graphs=none on CPU"),
        (
            parallel != ParallelBackend.mfsdp,
            f"needs distributed.backend=mfsdp (not {parallel}): its graph-safe "
            "gradient buffers are what the graph writes into",
        ),
        # Delayed scaling's amax and scale updates are kernels on static buffers, captured with the micro-batch;
        # current scaling keeps no state. The block recipes have not been checked against eager runs.
        (
            cfg.precision.fp8.enabled and cfg.precision.fp8.recipe not in GRAPHED_FP8_RECIPES,
            f"runs FP8 with precision.fp8.recipe={' or '.join(GRAPHED_FP8_RECIPES)}, not "
            f"{cfg.precision.fp8.recipe} (not checked under CUDA graphs); use training.cuda_graphs=none",
        ),
        (training.compile, "and training.compile=true both take over the forward pass: choose one"),
    ]
    return [why for refused, why in refusals if refused]


def cuda_graphs_mesh_refusals(cfg: DictConfig, dp_size: int, dp_outer: int, tp: int) -> list[str]:
    """Why this mesh cannot replay micro-batches as CUDA graphs ([] if it can). A replay launches recorded
    kernels only: a collective that must run inside a micro-batch would be skipped, or would have to be captured
    and has not been checked against eager runs. With several data-parallel ranks and ZeRO-0 a micro-batch holds
    none; its gradients are all-reduced after the step's last (core/training/cuda_graphs.py)."""
    cp = int(cfg.distributed.cp)
    if dp_size == 1 and tp == 1 and cp == 1:
        return []
    zero = int(cfg.distributed.mfsdp.zero_dp_strategy)
    refusals = [
        (tp > 1, f"needs distributed.tp=1 (not {tp}): tensor parallelism's collectives run inside every layer"),
        (cp > 1, f"needs distributed.cp=1 (not {cp}): context parallelism's exchanges run inside every attention"),
        (
            zero != 0,
            f"on {dp_size} data-parallel ranks needs distributed.mfsdp.zero_dp_strategy=0 (not {zero}): "
            "ZeRO-2/3 reduce-scatter gradients in every micro-batch's backward and ZeRO-1 has not been "
            "checked against eager runs under graphs; with ZeRO-0 no collective runs inside a micro-batch",
        ),
        (
            dp_outer > 1,
            f"on several ranks needs distributed.dp_outer=1 (not {dp_outer}): HSDP has not been checked "
            "against eager runs under graphs",
        ),
        (
            cfg.precision.fp8.enabled,
            f"on {dp_size} data-parallel ranks needs precision.fp8.enabled=false: FP8's amax "
            "all-reduce between ranks inside a graph has not been checked against eager runs",
        ),
    ]
    return [why for refused, why in refusals if refused]
