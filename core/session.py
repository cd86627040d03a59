"""The setup every entry point shares (train.py, predict.py, and any generation or export to come):

    with session.start(cfg, run_dir, get_recipe) as sess:   # config checked, runtime resolved, processes up
        parallel, num_params = session.build_model(sess)   # built by the recipe on every rank, parallelized
        ...

and the way each one ends: a clear line and an exit code for the errors a user can fix (`exit_on_error`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import torch.distributed as dist
from omegaconf import DictConfig
from omegaconf.errors import InterpolationResolutionError

from core.checkpointing.layout import CheckpointError
from core.checkpointing.saved_config import trained_config
from core.config import command_line
from core.config.errors import DEBUG_ENV, ConfigError, DataError, message_of
from core.config.validation import save_config, validate
from core.distributed import env as distributed
from core.distributed import failed_jobs, launch
from core.layers.namespace import get_layers
from core.layers.tensor_parallel import full_numel
from core.parallel.base import Parallel
from core.parallel.parallelize import parallelize
from core.runtime import Runtime, request_cuda_connections, resolve
from core.training import finetune, memory_plan
from core.training.nonfinite import NonFiniteError
from core.training.precision import autocast_factory

if TYPE_CHECKING:
    from recipes.base import Recipe

log = logging.getLogger("train")

EXIT_CODES = (
    (DataError, 2, "data error: "),
    (ConfigError, 2, "config error: "),
    (CheckpointError, 3, "checkpoint error: "),
    (NonFiniteError, 4, ""),
    (InterpolationResolutionError, 2, "config error: "),
)  # a ${...} of the config that does not resolve


@dataclass
class Session:
    cfg: DictConfig  # validated and read-only
    runtime: Runtime
    env: distributed.DistEnv
    recipe: "Recipe"
    run_dir: Path
    autocast: Callable[[], ContextManager]  # opens the forward pass's precision context

    @property
    def is_main(self) -> bool:
        return self.env.is_main


@contextlib.contextmanager
def start(cfg: DictConfig, run_dir: Path, get_recipe: Callable[[str], type]) -> Iterator[Session]:
    """Check the config, resolve the runtime, start the process group and device mesh (torn down on exit),
    instantiate the recipe and write <run dir>/resolved_config.yaml."""
    cfg = validate(cfg)
    recipe_type = get_recipe(cfg.recipe)
    cfg = recipe_type.resolve_config(cfg, is_main=launch.global_rank() == 0)  # e.g. sizes taken from the data
    recipe = recipe_type(cfg)
    if cfg.distributed.cp > 1:  # before any process starts: the recipe splits its sequences, or refuses
        recipe.check_context_parallel(int(cfg.distributed.cp))
    request_cuda_connections(recipe.cuda_connections())  # before anything starts CUDA
    runtime = resolve(cfg)
    dist_cfg = cfg.distributed
    env = distributed.setup(
        dist_cfg.dp_outer, dist_cfg.dp_shard, dist_cfg.tp, dist_cfg.timeout_minutes, runtime.device_type, dist_cfg.cp
    )
    try:
        runtime = runtime.on_mesh(cfg, env.dp_size, env.dp_outer, env.tp)
        # FP8 scales agree over all ranks that hold parts of the same tensors (data-, context- and tensor-parallel).
        amax_group = env.dp_cp_group if env.tp == 1 else dist.group.WORLD
        autocast = autocast_factory(env.device, runtime.autocast_dtype, runtime.fp8_recipe, amax_group)
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "resolved_config.yaml")
            log.info(
                "recipe %s | %d ranks on %s | distributed.backend=%s%s | mesh dp_outer=%d x dp_shard=%d%s x tp=%d "
                "| model.backend=%s%s%s | run dir %s",
                cfg.recipe,
                env.world_size,
                env.device.type,
                runtime.parallel,
                " (auto)" if runtime.parallel_auto else "",
                env.dp_outer,
                env.dp_shard,
                f" x cp={env.cp}" if env.cp > 1 else "",
                env.tp,
                runtime.layers,
                " (auto)" if runtime.layers_auto else "",
                " | micro-batches replayed as CUDA graphs" if runtime.cuda_graphs else "",
                run_dir,
            )
        yield Session(cfg, runtime, env, recipe, run_dir, autocast)
    finally:
        distributed.teardown()


def build_model(sess: Session, training: bool = True) -> tuple[Parallel, int]:
    """The recipe's model on this rank's device, weights drawn from cfg.seed (the same full weights on every
    rank; with distributed.tp > 1 each rank keeps its tensor-parallel part), made to train what finetune.mode says
    (core/training/finetune.py), wrapped by core.parallel
    (`training=False` leaves out activation recomputation and compilation). Returns it and its full
    parameter count."""
    if training:  # per-GPU memory from the settings: logged, and a run that cannot fit stops here, saying what would
        memory_plan.check_run(sess.cfg, sess.recipe, sess.env, sess.runtime, log)
    layers = get_layers(sess.runtime.layers, sess.env.tensor_parallel(), sess.env.context_parallel())
    model = sess.recipe.build_model(layers, sess.env.device)
    layers.cp.apply(model, layers.TransformerLayer)  # distributed.cp: attention over every cp rank's tokens
    # finetune.mode: which weights train (LoRA adapters added), before the wrappers see the parameters.
    summary = finetune.apply(model, sess.cfg.finetune, sess.cfg.seed, sess.runtime.autocast_dtype, sess.env.tp)
    if summary and sess.is_main:
        log.info("%s", summary)
    num_params = full_numel(model, sess.env.tp)
    train_cfg = sess.cfg.training
    parallel = parallelize(
        model,
        sess.runtime,
        sess.env,
        sess.cfg.distributed,
        layers,
        sess.recipe.unit_modules(layers),
        activation_checkpointing=training and train_cfg.activation_checkpointing,
        compile=training and train_cfg.compile,
    )
    return parallel, num_params


def exit_on_error(function: Callable[..., Any], *args: Any) -> Any:
    """Run an entry point's body; a config, data, checkpoint or non-finite error ends the process with one clear
    line and its exit code (2, 2, 3, 4) instead of a traceback (also with it when RECIPES_DEBUG=1). In a multirun
    job it ends that job only (core/distributed/failed_jobs.py)."""
    try:
        return function(*args)
    except tuple(error for error, _, _ in EXIT_CODES) as e:
        code, label = next((code, label) for error, code, label in EXIT_CODES if isinstance(e, error))
        if os.environ.get(DEBUG_ENV):
            log.error("the traceback (%s is set):", DEBUG_ENV, exc_info=e)
        log.error("%s%s", label, message_of(e))
        if failed_jobs.in_multirun_job():  # the sweep goes on with its next job
            raise failed_jobs.job_error(code, label, message_of(e)) from None
        raise SystemExit(code) from None


def config_of_init_from(argv: list[str], recipe_configs: dict[str, str]) -> Optional[tuple[str, str]]:
    """For launch.run_hydra, in predict.py and generate.py: (the config to compose, why) when the command line names no
    config but gives checkpoint.init_from: the one it was trained with, else its recipe's in `recipe_configs`
    (core/checkpointing/saved_config.py:trained_config); None without checkpoint.init_from. A checkpoint that cannot
    say ends the process with its one line and exit code."""
    init_from = command_line.override_value(argv, "checkpoint.init_from")
    if init_from is None:
        return None
    return exit_on_error(trained_config, init_from, command_line.configs(), recipe_configs)
