"""Train any recipe with Megatron-FSDP / FSDP2 / DDP, TransformerEngine or plain torch layers.

    torchrun --nproc-per-node N train.py --config-name vit_sanity [key=value ...]
    python train.py --config-name vit_sanity                       # one process

The loop below is the whole training procedure, top to bottom:
  1. config      - Hydra composes configs/<name>.yaml; we validate it against the schemas
  2. distributed - process group, device, device mesh (dp_outer x dp_shard x tp)
  3. model       - the recipe builds it from TE or torch layers, identical on every rank
  4. shard       - wrap it with the chosen data-parallel backend
  5. optimizer   - AdamW with weight-decay groups; warmup + decay schedule
  6. data        - the global batch split over ranks and micro-batches
  7. resume      - the newest complete checkpoint (model, optimizer, schedule, data position, RNG)
  8. loop        - micro-batches with gradient accumulation, clip, step, schedule, log, validate, save
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import hydra
import numpy as np
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from checkpoint import CheckpointError, Checkpointer, load_weights, set_rng_state
from core import config as config_lib
from core import activation_checkpointing, compilation, distributed, launch, optim, parallel, precision, tensor_parallel
from core import layers as layers_lib
from core.data import (EvalBatchSampler, GlobalBatchSampler, PaddedEval, accumulation_steps, make_loader,
                       prefetch_to_device)
from core.datasets import MultiEpochDatasetResampler
from core.metrics import MetricsLogger, PhaseTimer, peak_bf16_flops, peak_memory_gib
from core.preemption import StopSignals, parse_signals
from core.profiling import StepProfiler
from recipes import get_recipe

log = logging.getLogger("train")

config_lib.register_configs()
launch.register_resolvers()


@dataclass
class RunResult:
    steps: int
    train_loss: float  # mean loss of the last optimizer step
    val: dict = field(default_factory=dict)  # last validation metrics
    param_groups: list = field(default_factory=list)  # (group name, tensors, weight decay) as optimized
    model_state: Optional[dict] = None  # full weights, when asked for (tests)
    start_step: int = 0  # the step resumed from (0: a fresh start)
    resumed_from: Optional[str] = None  # the checkpoint resumed from
    stopped_by: Optional[str] = None  # the signal that stopped the run early (after saving)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss (training.on_nonfinite=skip)


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient norm with training.on_nonfinite=stop."""


@hydra.main(version_base="1.3", config_path="configs", config_name=None)
def main(cfg: DictConfig) -> Optional[float]:
    try:
        result = run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except config_lib.ConfigError as e:
        log.error("config error: %s", e)  # a clear line instead of a traceback
        raise SystemExit(2) from None
    except CheckpointError as e:
        log.error("checkpoint error: %s", e)
        raise SystemExit(3) from None
    except NonFiniteError as e:
        log.error("%s", e)
        raise SystemExit(4) from None
    return result.val.get("loss", result.train_loss)  # the objective Hydra sweepers minimise


def run(cfg: DictConfig, run_dir: Path, return_model_state: bool = False) -> RunResult:
    # 1. Config: strict check against the schemas (unknown keys, wrong types) before any work.
    cfg = config_lib.validate(cfg)

    # 2. Distributed: one process per GPU (or CPU process); a one-rank group for plain `python`.
    d = cfg.distributed
    env = distributed.setup(d.dp_outer, d.dp_shard, d.tp, d.timeout_minutes)
    try:
        return train(cfg, env, run_dir, return_model_state)
    finally:
        distributed.teardown()


def train(cfg: DictConfig, env: distributed.DistEnv, run_dir: Path, return_model_state: bool) -> RunResult:
    # Everything that can be refused is checked before any work.
    t = cfg.training
    recipe = get_recipe(cfg.recipe)(cfg)
    dist_backend = parallel.resolve_backend(cfg.distributed.backend, env.device)
    layer_backend = layers_lib.resolve_backend(cfg.model.backend, env.device)
    accum = accumulation_steps(t.global_batch_size, t.micro_batch_size, env.dp_size)
    if t.on_nonfinite not in ("stop", "skip"):
        raise config_lib.ConfigError(f"training.on_nonfinite={t.on_nonfinite!r}: expected stop or skip")
    # FP8 scales agree over all ranks that hold parts of the same tensors (data- and tensor-parallel).
    autocast = precision.autocast_factory(cfg.precision, env.device, layer_backend,
                                          amax_group=env.dp_group if env.tp == 1 else dist.group.WORLD)
    fp8_recipe = precision.fp8_recipe(cfg.precision.fp8) if cfg.precision.fp8.enabled else None
    checkpointer = Checkpointer(cfg.checkpoint, env.rank, env.world_size, env.device, config=cfg,
                                fp8_recipe=fp8_recipe)
    stop_signals = parse_signals(list(cfg.checkpoint.save_on_signals))
    # Dropout etc. differ between data-parallel ranks but agree within a tensor-parallel group.
    torch.manual_seed(cfg.seed + env.dp_rank)
    random.seed(cfg.seed + env.dp_rank)
    np.random.seed(cfg.seed + env.dp_rank)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "resolved_config.yaml")
        log.info(
            "recipe %s | %d ranks on %s | distributed.backend=%s%s | mesh dp_outer=%d x dp_shard=%d x tp=%d | "
            "model.backend=%s%s | run dir %s",
            cfg.recipe, env.world_size, env.device.type, dist_backend,
            " (auto)" if cfg.distributed.backend == "auto" else "", env.dp_outer, env.dp_shard, env.tp,
            layer_backend, " (auto)" if cfg.model.backend == "auto" else "", run_dir,
        )

    # 3. Model: built on this rank's device, weights drawn from cfg.seed (the same full weights on every
    #    rank; with distributed.tp > 1 each rank keeps its tensor-parallel part of them).
    layers = layers_lib.get_layers(layer_backend, env.tensor_parallel())
    model = recipe.build_model(layers, env.device)
    num_params = tensor_parallel.full_numel(model, env.tp)
    if t.activation_checkpointing:  # trade compute for memory: blocks recompute activations in backward
        activation_checkpointing.apply(model, recipe.unit_modules(layers), layer_backend)
    if t.compile:  # torch.compile block by block: fused elementwise kernels, same parameter names
        compilation.apply(model, recipe.unit_modules(layers))

    # 4. Shard: wrap for data parallelism; `par.module` is what we call, `par.inner` the bare model.
    par = parallel.shard(model, dist_backend, env, cfg.distributed, recipe.unit_modules(layers),
                         cfg.precision.param_dtype)

    # 5. Optimizer over the (sharded) parameters, in two groups: with and without weight decay.
    groups = optim.param_groups(par.named_parameters(), cfg.optim.weight_decay, recipe.no_weight_decay(par.inner))
    optimizer = par.finalize_optimizer(optim.build_optimizer(groups, cfg.optim))
    scheduler = optim.build_scheduler(optimizer, cfg.scheduler, cfg.training.steps)
    group_summary = [(g["name"], len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups]

    # 6. Resume: the newest complete checkpoint under checkpoint.path (or checkpoint.resume=<dir>)
    #    gives weights, optimizer, schedule and the position in the data; else init_from gives
    #    weights only; else we start from the fresh init.
    restored = checkpointer.restore(par, optimizer, scheduler)
    if restored is None and cfg.checkpoint.init_from:
        load_weights(par, cfg.checkpoint.init_from, list(cfg.checkpoint.init_skip_prefixes),
                     cfg.checkpoint.init_ignore_unexpected, env.is_main)
    elif restored is not None and cfg.checkpoint.init_from and env.is_main:
        log.info("checkpoint.init_from is not used: this run continues from its own checkpoint")
    resumed = restored.train_state if restored else {}
    start_step, consumed = resumed.get("step", 0), resumed.get("consumed_samples", 0)
    skipped_steps = resumed.get("skipped_steps", 0)

    # 7. Data: step k uses samples [k*G, (k+1)*G) of the shuffled stream, split over ranks and
    #    micro-batches; gradient accumulation makes up the rest of the global batch. The stream
    #    depends only on the samples consumed, so a resumed run (on any number of ranks) continues
    #    at the exact next sample.
    data = recipe.build_datasets()
    pin = env.device.type == "cuda" and cfg.data.pin_memory
    train_stream = MultiEpochDatasetResampler(data.train, num_samples=t.steps * t.global_batch_size, seed=cfg.seed)
    sampler = GlobalBatchSampler(t.micro_batch_size, t.global_batch_size, env.dp_size, env.dp_rank, consumed)
    if restored and resumed.get("dataset_len") not in (0, len(data.train)) and env.is_main:
        log.warning("the training set has %d samples, the checkpoint's had %d: the sample order differs from "
                    "the interrupted run's", len(data.train), resumed["dataset_len"])
    # Worker seeds follow the data-parallel rank: tensor-parallel peers must see the same batches.
    train_loader = make_loader(train_stream, sampler, cfg.data.num_workers, pin, cfg.seed + env.dp_rank,
                               recipe.collate_fn(), stop_signals)
    val_loader = None
    if data.val is not None and t.limit_val_batches != 0:
        val_loader = make_loader(
            PaddedEval(data.val),
            EvalBatchSampler(len(data.val), t.micro_batch_size, env.dp_size, env.dp_rank, t.limit_val_batches),
            cfg.data.num_workers, pin, cfg.seed, recipe.collate_fn(), stop_signals,
        )

    logger = MetricsLogger(run_dir, cfg.logger, env.is_main, t.steps, start_step, OmegaConf.to_container(cfg),
                           run_name=run_dir.name)
    peak = peak_bf16_flops(env.device)
    flops_per_sample, tokens_per_sample = recipe.flops_per_sample(), recipe.tokens_per_sample()
    if env.is_main:
        log.info("model %.2fM parameters | train %d samples, val %s | global batch %d = micro-batch %d x %d ranks x "
                 "%d accumulation steps | %d steps | AdamW groups %s", num_params / 1e6, len(data.train),
                 len(data.val) if data.val is not None else "none", t.global_batch_size, t.micro_batch_size,
                 env.dp_size, accum, t.steps,
                 ", ".join(f"{name}: {n} tensors, weight_decay {wd}" for name, n, wd in group_summary))

    # 8. The loop. `step` counts optimizer steps completed.
    model = par.module
    model.train()
    # The micro-batches this run takes; the next one's host-to-device copy overlaps the current step.
    train_iter = prefetch_to_device(iter(train_loader), env.device, max(0, t.steps - start_step) * accum,
                                    recipe.to_device)
    timer = PhaseTimer(t.time_phases, env.device)
    profiler = StepProfiler(t.profile, run_dir, env.rank, env.device, first_step=start_step + 1)
    last_loss, last_val, stopped_by = float("nan"), {}, None
    signals = StopSignals(stop_signals)
    # First step whose loss or gradient norm was NaN/Inf (inf: none), kept on the device: checking
    # it needs a host sync, done only at log and save steps.
    first_nonfinite = torch.full((), float("inf"), device=env.device)
    if restored is not None:
        if restored.rng is not None:
            set_rng_state(restored.rng, env.device)  # dropout etc. continue exactly as uninterrupted
        elif env.is_main:
            log.warning("the checkpoint has no RNG state for some ranks (saved on fewer ranks): they keep "
                        "their seeded state")
    if start_step >= t.steps and env.is_main:
        log.info("the checkpoint is at step %d of training.steps=%d: nothing left to do", start_step, t.steps)
    interval_start, interval_steps, excluded, data_wait = time.perf_counter(), 0, 0.0, 0.0
    for step in range(start_step + 1, t.steps + 1):
        fetch_start = time.perf_counter()
        micro_batches = [next(train_iter) for _ in range(accum)]
        data_wait += time.perf_counter() - fetch_start

        # The loss is the mean over every loss term (sample or token) of the global batch, so count
        # them first. The backends average gradients over data-parallel ranks; dp_size undoes that.
        count = sum(recipe.loss_count(b) for b in micro_batches).to(env.device, torch.float64)
        dist.all_reduce(count, group=env.dp_group)
        loss_scale = env.dp_size / count  # a device tensor: no host sync here
        loss_sum = torch.zeros((), device=env.device)
        with timer.phase("forward_backward"):
            for i, batch in enumerate(micro_batches):
                with par.micro_batch(is_last=i == accum - 1):
                    with autocast():
                        out = recipe.forward(model, batch, training=True)
                    micro_loss = out["loss"].sum()
                    (micro_loss * loss_scale).backward()
                loss_sum += micro_loss.detach()

        with timer.phase("grad_sync_clip"):
            par.finish_grad_sync()
            grad_norm = par.clip_grad_norm(cfg.optim.max_grad_norm)
        lr = optimizer.param_groups[0]["lr"]
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss_sum)
        if t.on_nonfinite == "skip" and not all_ranks_true(finite):
            skipped_steps += 1  # drop this step's gradients: weights, optimizer and schedule stay put
            par.zero_grad(optimizer)
            log.warning("step %d: non-finite loss or gradient norm; optimizer step skipped (%d so far)",
                        step, skipped_steps)
        else:
            first_nonfinite = torch.where(finite | (first_nonfinite < step), first_nonfinite, step)
            with timer.phase("optimizer"):
                par.optimizer_step(optimizer)
                scheduler.step()
                par.zero_grad(optimizer)
        logger.advance()
        interval_steps += 1
        consumed += t.global_batch_size
        is_last = step == t.steps
        stop = signals.stop_requested()
        saving = checkpointer.should_save(step, t.steps) or stop
        if step % t.log_every_n_steps == 0 or is_last or saving:
            check_finite(first_nonfinite, env)  # never log on, or save, a NaN model

        if step % t.log_every_n_steps == 0 or is_last:
            # Host syncs (.item()) happen only here, at log steps.
            dist.all_reduce(loss_sum, group=env.dp_group)
            last_loss = (loss_sum / count).item()
            step_time = (time.perf_counter() - interval_start - excluded) / interval_steps
            samples_per_gpu = t.global_batch_size / step_time / env.world_size
            record = {"step": step, "loss": last_loss, "lr": lr, "grad_norm": grad_norm.item(),
                      "step_time": step_time, "data_wait": data_wait / interval_steps,
                      "samples_per_sec_per_gpu": samples_per_gpu,
                      "tokens_per_sec_per_gpu": samples_per_gpu * tokens_per_sample}
            if peak is not None:
                record["mfu"] = samples_per_gpu * flops_per_sample / peak
            record["peak_mem_gib"] = peak_memory_gib(env.device)
            if skipped_steps:
                record["skipped_steps"] = skipped_steps
            record.update(timer.pop_means(interval_steps))
            logger.log(record)
            interval_start, interval_steps, excluded, data_wait = time.perf_counter(), 0, 0.0, 0.0

        pause = time.perf_counter()
        step_val = {}
        if val_loader is not None and ((t.val_every_n_steps > 0 and step % t.val_every_n_steps == 0)
                                       or (is_last and t.val_at_end)):
            last_val = step_val = validate(recipe, model, val_loader, autocast, env)
            logger.log({"step": step, **last_val}, prefix="val")
            checkpointer.check_monitor({f"val/{k}": v for k, v in step_val.items()})
        checkpointer.poll()  # completes a finished async save
        if saving:
            train_state = {"step": step, "consumed_samples": consumed, "epoch": consumed // len(data.train),
                           "skipped_steps": skipped_steps, "dataset_len": len(data.train),
                           "world_size": env.world_size}
            stall = checkpointer.save(step, par, optimizer, scheduler, train_state,
                                      {f"val/{k}": v for k, v in step_val.items()}, force_sync=stop)
            logger.log({"step": step, "stall_s": stall}, prefix="checkpoint")
        excluded += time.perf_counter() - pause
        profiler.step()
        if stop:
            stopped_by = signals.received or "a signal on another rank"
            if env.is_main:
                log.warning("stopping after step %d on %s; checkpoint saved: run the same command to resume",
                            step, stopped_by)
            break

    checkpointer.wait()  # an async save still in flight
    profiler.close()
    signals.close()
    logger.close()
    model_state = par.full_state_dict() if return_model_state else None
    return RunResult(t.steps, last_loss, last_val, group_summary, model_state, start_step,
                     str(restored.path) if restored else None, stopped_by, skipped_steps)


def all_ranks_true(flag: torch.Tensor) -> bool:
    """One decision for all ranks (a collective and a host sync)."""
    flag = flag.to(torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_finite(first_nonfinite: torch.Tensor, env: distributed.DistEnv) -> None:
    """Raise on every rank if any rank saw a NaN/Inf loss or gradient norm (a host sync)."""
    first = first_nonfinite.clone()
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    if torch.isfinite(first).item():
        raise NonFiniteError(f"non-finite loss or gradient norm at step {int(first.item())}; stopping without "
                             "saving it (training.on_nonfinite=skip skips such steps instead)")


@torch.no_grad()
def validate(recipe, model, loader, autocast, env: distributed.DistEnv) -> dict[str, float]:
    """Metric sums over the whole (or limited) validation set, reduced over data-parallel ranks."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch in loader:
        valid = batch.pop("valid").to(env.device, torch.float64)
        batch = recipe.to_device(batch, env.device)
        with autocast():
            out = recipe.forward(model, batch, training=False)
        for key, value in out.items():
            sums[key] = sums.get(key, 0) + (value.to(torch.float64) * valid).sum()
    model.train()
    keys = sorted(sums)
    totals = torch.stack([sums[k] for k in keys])
    dist.all_reduce(totals, group=env.dp_group)
    totals = dict(zip(keys, totals.tolist()))
    count = totals.pop("count")
    return recipe.summarize_validation({k: v / count for k, v in totals.items()})


if __name__ == "__main__":
    launch.prepare_argv()
    main()
    launch.exit_process(0)
