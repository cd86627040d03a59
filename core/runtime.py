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

    def on_mesh(self, dp_size: int, tp: int) -> "Runtime":
        """What still holds once the mesh is known: CUDA graphs capture one data-parallel rank without tensor
        parallelism (the gradient reduction between ranks is not captured)."""
        if not self.cuda_graphs or (dp_size == 1 and tp == 1):
            return self
        if not self.cuda_graphs_auto:
            raise ConfigError(f"training.cuda_graphs=forward_backward runs on one data-parallel rank without tensor "
                              f"parallelism (this run: {dp_size} data-parallel x tp {tp}): the gradient reduction "
                              "between ranks is not captured; use training.cuda_graphs=auto or none")
        log.info("training.cuda_graphs=auto: eager micro-batches (%d data-parallel ranks x tp %d; CUDA graphs "
                 "capture one rank without tensor parallelism)", dp_size, tp)
        return replace(self, cuda_graphs=False)

    @functools.cached_property
    def fp8_recipe(self) -> Any:
        """TE's FP8 recipe object, or None. Built at first use, after the process has picked its GPU:
        importing TransformerEngine before that could open a CUDA context on GPU 0 in every process."""
        return fp8_recipe(self.fp8) if self.fp8 is not None else None


def resolve_parallel_backend(backend: ParallelBackend, machine: Machine) -> ParallelBackend:
    if backend == ParallelBackend.auto:
        return ParallelBackend.mfsdp if machine.cuda else ParallelBackend.fsdp2
    if backend == ParallelBackend.mfsdp and not machine.cuda:
        raise ConfigError("distributed.backend=mfsdp needs CUDA GPUs (Megatron-FSDP is CUDA-only); "
                          "use fsdp2 or ddp on CPU")
    return ParallelBackend(backend)


def resolve_layer_backend(backend: LayerBackend, machine: Machine) -> LayerBackend:
    if backend == LayerBackend.auto:
        if machine.cuda and machine.te:
            return LayerBackend.te
        if machine.cuda:
            log.warning("TransformerEngine is not installed: using plain torch layers "
                        "(pip install transformer-engine[pytorch], or the NGC PyTorch container)")
        return LayerBackend.torch
    if backend == LayerBackend.te:
        if not machine.cuda:
            raise ConfigError("model.backend=te needs a CUDA device; use model.backend=torch (or auto) on CPU")
        if not machine.te:
            raise ConfigError("model.backend=te but TransformerEngine is not installed "
                              "(pip install transformer-engine[pytorch])")
    return LayerBackend(backend)


def resolve(cfg: DictConfig, machine: Optional[Machine] = None) -> Runtime:
    """The runtime of a validated config on this machine; a ConfigError for what cannot run here."""
    machine = machine or Machine.detect()
    parallel = resolve_parallel_backend(cfg.distributed.backend, machine)
    layers = resolve_layer_backend(cfg.model.backend, machine)
    precision, tp = cfg.precision, cfg.distributed.tp
    if parallel == ParallelBackend.ddp and precision.param_dtype != DType.fp32:
        raise ConfigError(f"distributed.backend=ddp with precision.param_dtype={precision.param_dtype}: DDP would "
                          "train the weights themselves in that dtype, with no fp32 master copy; use "
                          "precision.param_dtype=fp32 with ddp, or mfsdp / fsdp2, which keep fp32 master weights")
    if tp > 1 and parallel == ParallelBackend.ddp:
        raise ConfigError("distributed.tp > 1 needs distributed.backend=mfsdp or fsdp2 (ddp keeps whole replicas)")
    if tp > 1 and parallel == ParallelBackend.fsdp2 and layers == LayerBackend.te:
        raise ConfigError("distributed.tp > 1 with distributed.backend=fsdp2 needs model.backend=torch; "
                          "TE layers are tensor-parallel under distributed.backend=mfsdp")
    if precision.fp8.enabled and layers != LayerBackend.te:
        raise ConfigError("precision.fp8.enabled needs TransformerEngine layers (model.backend=te on a CUDA GPU)")
    graphs = cfg.training.cuda_graphs == CudaGraphs.forward_backward
    if graphs:
        check_cuda_graphs(cfg, machine, parallel)
    elif cfg.training.cuda_graphs == CudaGraphs.auto:
        graphs = not cuda_graphs_refusals(cfg, machine, parallel)
    autocast = DTYPES[precision.autocast_dtype] if precision.autocast_dtype is not None else None
    return Runtime(
        device_type="cuda" if machine.cuda else "cpu", parallel=parallel, layers=layers, autocast_dtype=autocast,
        param_dtype=DTYPES[precision.param_dtype], fp8=precision.fp8 if precision.fp8.enabled else None,
        cuda_graphs=graphs, cuda_graphs_auto=cfg.training.cuda_graphs == CudaGraphs.auto,
        parallel_auto=cfg.distributed.backend == ParallelBackend.auto, layers_auto=cfg.model.backend == LayerBackend.auto)


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
        (parallel != ParallelBackend.mfsdp, f"needs distributed.backend=mfsdp (not {parallel}): its graph-safe "
                                            "gradient buffers are what the graph writes into"),
        # Delayed scaling's amax and scale updates are kernels on static buffers, captured with the micro-batch;
        # current scaling keeps no state. The block recipes have not been checked against eager runs.
        (cfg.precision.fp8.enabled and cfg.precision.fp8.recipe not in GRAPHED_FP8_RECIPES,
         f"runs FP8 with precision.fp8.recipe={' or '.join(GRAPHED_FP8_RECIPES)}, not "
         f"{cfg.precision.fp8.recipe} (not checked under CUDA graphs); use training.cuda_graphs=none"),
        (training.compile, "and training.compile=true both take over the forward pass: choose one"),
    ]
    return [why for refused, why in refusals if refused]
