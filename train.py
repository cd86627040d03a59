"""Train any recipe with Megatron-FSDP / FSDP2 / DDP, TransformerEngine or plain torch layers.

    torchrun --nproc-per-node N train.py --config-name vit_sanity [key=value ...]
    python train.py --config-name vit_sanity                       # one process

Read top to bottom:
  setup()       everything a run holds, refused before any work if it cannot run: the shared session
                (config, runtime, processes, device mesh), the model built and parallelized, optimizer and
                schedule, data, logger, then the newest checkpoint restored (or init_from's weights)
  train()       the loop: micro-batches -> train_step() -> log, validate, maybe save, stop on a signal (or when a
                callback asks); the run's callbacks (the logger, the meter, training.callbacks) observe each step
  train_step()  forward and backward over one optimizer step's micro-batches, clip, step
The loop talks to the checkpointer in three calls: restore, maybe_save and close (core/checkpointing/manager.py).
docs/architecture.md follows one step through the files; docs/callbacks.md shows how to observe a run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
import numpy as np
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core import session
from core.checkpointing.changes import data_changes
from core.checkpointing.manager import Checkpointer, open_checkpointer
from core.checkpointing.parts import training_parts
from core.checkpointing.weights import load_weights
from core.config.errors import ConfigError
from core.config.validation import check_monitored_metrics, to_plain
from core.data.fingerprint import data_fingerprint
from core.data.pipeline import TrainingData
from core.data.sampling import accumulation_steps
from core.distributed import launch
from core.distributed.signals import StopSignals, parse_signals
from core.metrics.logger import MetricsLogger
from core.metrics.meter import ThroughputMeter
from core.metrics.profiling import StepProfiler
from core.parallel.base import Parallel
from core.training import cuda_graphs, finetune, optim
from core.training.callbacks import Callback, Callbacks, build_callbacks
from core.training.evaluation import evaluate
from core.training.forward_backward import ForwardBackward
from core.training.length import RunLength
from core.training.nonfinite import NonFiniteGuard
from core.training.schedule import StepSchedule
from core.training.state import TrainState
from recipes.registry import config_keys, get_recipe, hf_weights_reader, register_configs

log = logging.getLogger("train")


@dataclass
class Run:
    """Everything one training run holds: made by setup(), advanced by train()."""

    session: session.Session  # cfg, runtime, env (ranks, device, mesh), recipe, run_dir, autocast
    parallel: Parallel  # the model, wrapped for data (and tensor) parallelism
    forward_backward: ForwardBackward  # one micro-batch's forward and backward (eager, or a CUDA graph replayed)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: TrainingData
    checkpointer: Checkpointer
    logger: MetricsLogger
    meter: ThroughputMeter
    guard: NonFiniteGuard
    length: RunLength  # optimizer steps (training.steps, or worked out from training.epochs) and epoch ends
    schedule: StepSchedule  # which steps log, validate and save
    callbacks: (
        Callbacks  # what observes the run: the logger, the meter, training.callbacks (core/training/callbacks.py)
    )
    state: TrainState = field(default_factory=TrainState)
    resumed_from: Optional[Path] = None
    stop_reason: Optional[str] = None  # a callback asked the run to stop (request_stop)

    def request_stop(self, reason: str) -> None:
        """Stop as on a stop signal: at the end of the next step every rank agrees, saves that step and leaves."""
        self.stop_reason = self.stop_reason or reason


@dataclass
class RunResult:
    steps: int
    train: dict  # the last logged optimizer step's loss (mean over the global batch), lr and grad_norm
    val: dict = field(default_factory=dict)  # last validation metrics
    start_step: int = 0  # the step resumed from (0: a fresh start)
    resumed_from: Optional[str] = None  # the checkpoint resumed from
    stopped_by: Optional[str] = None  # the signal (or a callback's reason) that stopped the run early, after saving
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss (training.on_nonfinite=skip)


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # this rank's summed loss terms (on the device: no host sync per step)
    count: torch.Tensor  # the loss terms of the whole global batch
    grad_norm: torch.Tensor  # before clipping
    lr: float  # the learning rate the step used


@hydra.main(version_base="1.3", config_path="configs", config_name=None)
def main(cfg: DictConfig) -> Optional[float]:
    result = session.exit_on_error(run, cfg, Path(HydraConfig.get().runtime.output_dir))
    launch.pass_on_stop_signal(result.stopped_by)  # saved: a SLURM job launched by Hydra is requeued now
    # training.objective.metric: what a sampling sweeper (hydra/sweeper=optuna_objective) optimises.
    return session.exit_on_error(objective, result, cfg.training.objective.metric, launch.optimising_sweep())


def run(cfg: DictConfig, run_dir: Path) -> RunResult:
    launch.check_sweeper(str(cfg.training.objective.direction))  # before any work
    launch.separate_checkpoint_path(cfg)  # a multirun's jobs each get a folder of their own under checkpoint.path
    # Validation reads the schemas from Hydra's store. Registered again here (a no-op when there) for the processes
    # that never ran __main__: a job hydra-submitit-launcher starts (it unpickles main) and a caller from Python.
    register_configs()
    with session.start(cfg, run_dir, get_recipe) as sess:
        launch.describe_checkpoint_path(cfg)  # the default folder, and why this one: the same command again resumes it
        return train(setup(sess, objective_required=launch.optimising_sweep()))


def build_schedule(optimizer: torch.optim.Optimizer, cfg: DictConfig, steps: int) -> Any:
    """The learning-rate schedule over the run's `steps`; what it cannot do as its settings say (a warmup as long as
    the run, a wsd decay that does not fit) is warned about before the first step."""
    for note in optim.schedule_notes(cfg.scheduler, cfg.optim.lr, steps):
        log.warning("%s", note)
    return optim.build_scheduler(optimizer, cfg.scheduler, steps)


def setup(sess: session.Session, objective_required: bool = False, callbacks: tuple[Callback, ...] = ()) -> Run:
    """Everything a run holds, in the order it is needed; what can be refused is refused before the work.
    `objective_required`: a sweeper optimises training.objective.metric, so the run must record it.
    `callbacks`: observers of the run besides the logger, the meter and training.callbacks' (a caller from Python)."""
    cfg, env, training = sess.cfg, sess.env, sess.cfg.training
    with contextlib.ExitStack() as on_failure:  # what setup opened, closed again if a later step fails
        # 1. Checks: checkpoint.path's lock and where to resume from (an explicit checkpoint must be complete,
        #    a resumed run must keep its result-changing settings), the global batch's split, the user's callbacks.
        checkpointer = open_checkpointer(
            cfg.checkpoint, env.rank, env.device, config=cfg, config_name=launch.config_name()
        )
        on_failure.callback(checkpointer.close)
        accumulation = accumulation_steps(training.global_batch_size, training.micro_batch_size, env.dp_size)
        user_callbacks = build_callbacks(training.callbacks)
        # 2. Seeds: dropout etc. differ between ranks that hold different tokens (data- and context-parallel) but
        #    agree within a tensor-parallel group.
        for seed in (torch.manual_seed, random.seed, np.random.seed):
            seed(cfg.seed + env.dp_cp_rank)
        # 3. The model, built by the recipe on every rank and parallelized (core/session.py).
        parallel, num_params = session.build_model(sess)
        # 4. Data; its size gives the run's length when it is given in epochs. With it, whether the run validates:
        #    checkpoint.monitor and training.objective.metric must name metrics the run records.
        data = TrainingData(sess.recipe, cfg, env, accumulation, parse_signals(cfg.checkpoint.save_on_signals))
        schedule = StepSchedule.from_config(cfg, data.length)
        check_monitored_metrics(
            cfg, sess.recipe.validation_metrics(), data.val_loader is not None, schedule, objective_required
        )
        # 5. AdamW over the (sharded) trainable parameters in two groups, with and without weight decay (crossed with
        #    finetune's learning-rate parts: head, backbone, layer decay); the schedule.
        groups = optim.param_groups(
            parallel.named_parameters(),
            cfg.optim.weight_decay,
            sess.recipe.no_weight_decay(parallel.model),
            cfg.optim.lr,
            cfg.finetune,
            parallel.blocks,
        )
        optimizer = parallel.finalize_optimizer(optim.build_optimizer(groups, cfg.optim))
        scheduler = build_schedule(optimizer, cfg, data.length.steps)
        # 6. The micro-batch step, replayed as a CUDA graph with training.cuda_graphs; logging, throughput, the NaN
        #    policy.
        forward_backward = cuda_graphs.forward_backward(
            parallel, sess.recipe, sess.autocast, sess.runtime.cuda_graphs, sess.runtime.layers == "te"
        )
        logger = MetricsLogger(sess.run_dir, cfg.logger, env.is_main, to_plain(cfg), cfg.checkpoint.path)
        on_failure.callback(logger.close)  # a run that never started leaves no open W&B run
        meter = ThroughputMeter(
            env.device,
            training.global_batch_size,
            env.world_size,
            sess.recipe.tokens_per_sample(),
            sess.recipe.flops_per_sample(),
            training.time_phases,
            ranks_per_sample=env.tp * env.cp,
        )
        run = Run(
            sess,
            parallel,
            forward_backward,
            optimizer,
            scheduler,
            data,
            checkpointer,
            logger,
            meter,
            NonFiniteGuard(training.on_nonfinite, env.device),
            data.length,
            schedule,
            Callbacks([logger, *user_callbacks, *callbacks, meter]),
        )  # the meter last: it starts timing
        # 7. Resume, last: the restored RNG state must meet the first step untouched. A step folder the run would
        #    save over but may not replace stops it here. The run's history (run dir, metrics.jsonl, W&B,
        #    TensorBoard) continues from the step resumed from.
        run.resumed_from = restore(run)
        logger.open(run.state.step, resumed=run.resumed_from is not None)
        on_failure.pop_all()  # the run holds them now; train() closes them
    if env.is_main:
        log_setup(run, num_params, accumulation)
    return run


def log_setup(run: Run, num_params: int, accumulation: int) -> None:
    """One line on what the run trains: the model's size, the data, how the global batch is split, the run's length
    and the optimizer's parameter groups."""
    training, data = run.session.cfg.training, run.data
    log.info(
        "model %.2fM parameters | train %d samples, val %s | global batch %d = micro-batch %d x %d ranks x "
        "%d accumulation steps | %s | AdamW groups %s",
        num_params / 1e6,
        len(data.train),
        len(data.val) if data.val is not None else "none",
        training.global_batch_size,
        training.micro_batch_size,
        run.session.env.dp_size,
        accumulation,
        run.length.describe(training.epochs),
        ", ".join(
            f"{g['name']}: {len(g['params'])} tensors, weight_decay {g['weight_decay']}"
            + (f", lr {g['lr_scale']:.3g} x optim.lr" if "lr_scale" in g else "")
            for g in run.optimizer.param_groups
        ),
    )


def restore(run: Run) -> Optional[Path]:
    """The newest complete checkpoint under checkpoint.path (or checkpoint.resume=<dir>) gives weights,
    optimizer, schedule, the position in the data and the RNG states; else init_from gives weights only;
    else the run starts from the fresh init. The checkpointer keeps the parts: every save writes them."""
    ckpt, env, state = run.session.cfg.checkpoint, run.session.env, run.state
    parts = training_parts(run.parallel, run.optimizer, run.scheduler, state, env, run.session.runtime.fp8_recipe)
    path = run.checkpointer.restore(parts, state, run.length.steps, run.schedule.saves)
    if path is not None:  # the learning rate and optimizer settings in effect are the config's; the schedule's length
        cfg = run.session.cfg
        for note in optim.resume_schedule(
            run.optimizer, run.scheduler, cfg.optim, cfg.scheduler, state, run.length.steps
        ):
            if env.is_main:
                log.warning("%s", note)
    else:
        state.schedule_steps = run.length.steps
    if path is None and ckpt.init_from:
        cfg = run.session.cfg
        reader = hf_weights_reader(cfg.recipe)  # a Hugging Face folder, converted in memory
        load_weights(
            run.parallel,
            ckpt.init_from,
            list(ckpt.init_skip_prefixes),
            ckpt.init_ignore_unexpected,
            env.is_main,
            ckpt.verify_checksums,
            functools.partial(reader, model=cfg.model) if reader else None,
            # a task head and LoRA adapters the source lacks keep their fresh init (a pretrained backbone)
            lambda name: finetune.in_head(name, list(cfg.finetune.head)) or finetune.is_lora(name),
        )
    elif path is not None and env.is_main:
        log.info("resumed from %s (step %d, %d samples consumed)", path, state.step, state.consumed_samples)
        if ckpt.init_from:
            log.info("checkpoint.init_from is not used: this run continues from its own checkpoint")
    fingerprint = data_fingerprint(run.data.train)
    if path is not None:
        check_same_data(path, state, fingerprint, len(run.data.train), ckpt.allow_config_changes, env.is_main)
    state.dataset_len, state.world_size, state.data_fingerprint = len(run.data.train), env.world_size, fingerprint
    return path


def check_same_data(path: Path, state: TrainState, fingerprint: int, length: int, allowed: bool, is_main: bool) -> None:
    """A resume on another training set than its checkpoint's (core/checkpointing/changes.py:data_changes) stops
    before any work, as a changed data setting does, unless checkpoint.allow_config_changes=true continues on
    purpose: the run would otherwise go on silently with another sample order, or with other labels. A changed
    length of a dataset without a fingerprint is a warning (GPT's grows when training.steps passes an epoch)."""
    changes, refused = data_changes(state.dataset_len, state.data_fingerprint, length, fingerprint)
    if refused and not allowed:
        raise ConfigError(
            f"resuming from {path}, but the training data differs from the data it was trained on ("
            + "; ".join(changes)
            + "): the run would continue on another sample order or other labels. Restore the data, give a "
            "new run a folder of its own (checkpoint.path=<a new folder>, checkpoint.init_from="
            + str(path)
            + " for these weights), or continue on this data on purpose with checkpoint.allow_config_changes=true"
        )
    if changes and is_main:
        log.warning(
            "resuming from %s on changed training data (%s): the sample order differs", path, "; ".join(changes)
        )


def train(run: Run) -> RunResult:
    """The loop. `step` counts optimizer steps completed; run.state, saved with checkpoints, follows it."""
    sess, training, state, steps = run.session, run.session.cfg.training, run.state, run.length.steps
    start_step, last_train, last_val, stopped_by = state.step, {}, {}, None
    if start_step >= steps and sess.is_main:
        log.info(
            "the checkpoint %s is at step %d of %d: nothing left to do. To train this run longer, raise "
            "training.steps (it continues from step %d); to train a new run, give it a folder of its own: "
            "checkpoint.path=<a new folder>",
            run.resumed_from,
            start_step,
            steps,
            start_step,
        )
    batches = run.data.micro_batches(state.consumed_samples, max(0, steps - start_step) * run.data.accumulation)
    profiler = StepProfiler(training.profile, sess.run_dir, sess.env.rank, sess.env.device, first_step=start_step + 1)
    signals = StopSignals(parse_signals(sess.cfg.checkpoint.save_on_signals))
    try:
        run.callbacks.on_train_start(run)  # the progress bar; the meter times from here (not setup and restore)
        for step in range(start_step + 1, steps + 1):
            with run.meter.waiting_for_data():
                micro_batches = [next(batches) for _ in range(run.data.accumulation)]
            out = train_step(run, step, micro_batches)
            state.step, state.consumed_samples = step, state.consumed_samples + training.global_batch_size
            state.epoch = state.consumed_samples // len(run.data.train)
            run.meter.step_done()
            # On every rank if any rank got a signal, or a callback asked to stop (at an earlier step).
            stop = signals.stop_requested(asked=run.stop_reason is not None)
            saving = run.schedule.saves(step) or stop
            logging_step = run.schedule.logs(step)
            figures = {}
            if logging_step or saving:
                run.guard.check()  # never log on, or save, a NaN model
                figures = step_figures(run, out)
            if logging_step:
                last_train = figures
            # The logger writes the step's record (at logging steps); other callbacks see the step too.
            run.callbacks.on_step_end(run, step, micro_batches, log_record(run, figures) if logging_step else {})
            with run.meter.outside_steps():  # validation and saving do not count as step time
                step_val = validate(run, step)
                last_val = step_val or last_val
                # Every step: a finished async save is completed; at save steps step_<N> is saved with the
                # step's figures (checkpoint.monitor ranks checkpoints by one of them), synchronously when stopping.
                stall = run.checkpointer.maybe_save(
                    step, {"train": figures if saving else {}, "val": step_val}, save=saving, sync=stop
                )
                if stall is not None:
                    run.callbacks.on_save(run, step, stall)
            profiler.step()
            if stop:
                stopped_by = signals.received or run.stop_reason or "a signal on another rank"
                if sess.is_main:
                    log.warning(
                        "stopping after step %d on %s; checkpoint saved: run the same command to resume",
                        step,
                        stopped_by,
                    )
                break
    finally:
        profiler.close()
        signals.close()
        run.logger.close()
        run.checkpointer.close()
    result = RunResult(
        steps,
        last_train,
        last_val,
        start_step,
        str(run.resumed_from) if run.resumed_from else None,
        stopped_by,
        state.skipped_steps,
    )
    run.callbacks.on_train_end(run, result)
    return result


def train_step(run: Run, step: int, micro_batches: list[dict]) -> StepOutput:
    """One optimizer step: forward and backward over the micro-batches (the backend reduces gradients over
    data-parallel ranks after the last one), clip, then step the optimizer and the schedule, or drop the
    step's gradients if its loss or gradient norm is not finite and training.on_nonfinite=skip."""
    parallel, env, recipe, meter = run.parallel, run.session.env, run.session.recipe, run.meter
    last = len(micro_batches) - 1
    # The loss is the mean over every loss term (sample or token) of the global batch, so count them first (over
    # the ranks holding different tokens: data- and context-parallel). The backends average gradients over those
    # ranks; dp_cp_size undoes that.
    count = sum(recipe.loss_count(b) for b in micro_batches).to(env.device, torch.float64)
    dist.all_reduce(count, group=env.dp_cp_group)
    loss_scale = env.dp_cp_size / count  # a device tensor: no host sync here
    meter.add_work([recipe.work(b) for b in micro_batches])  # real tokens and FLOPs where samples differ
    loss_sum = torch.zeros((), device=env.device)
    with meter.phase("forward_backward"):
        for i, batch in enumerate(micro_batches):
            loss_sum += run.forward_backward(batch, loss_scale, is_last=i == last)
    with meter.phase("grad_sync_clip"):
        parallel.finish_grad_sync()
        grad_norm = parallel.clip_grad_norm(run.session.cfg.optim.max_grad_norm)
    lr = run.optimizer.param_groups[0]["lr"]
    finite = torch.isfinite(grad_norm) & torch.isfinite(loss_sum)
    if run.guard.step_may_proceed(step, finite, run.state.skipped_steps):
        with meter.phase("optimizer"):
            parallel.optimizer_step(run.optimizer)
            run.scheduler.step()
            parallel.zero_grad(run.optimizer)
    else:
        run.state.skipped_steps += 1
        parallel.zero_grad(run.optimizer)  # weights, optimizer and schedule stay put
    return StepOutput(loss_sum, count, grad_norm, lr)


def step_figures(run: Run, out: StepOutput) -> dict[str, float]:
    """The step's mean loss over the global batch, learning rate and gradient norm (host syncs happen only here,
    at logging and saving steps)."""
    dist.all_reduce(out.loss_sum, group=run.session.env.dp_cp_group)
    return {"loss": (out.loss_sum / out.count).item(), "lr": out.lr, "grad_norm": out.grad_norm.item()}


def log_record(run: Run, figures: dict[str, float]) -> dict[str, float]:
    """What a logging step logs: its figures and the meter's (throughput, memory) since the last record."""
    record = {**figures, **run.meter.record()}
    if run.state.skipped_steps:
        record["skipped_steps"] = run.state.skipped_steps
    return record


def validate(run: Run, step: int) -> dict[str, float]:
    """The validation metrics at a validation step (every val_every_n_steps, and at the end), else {}."""
    sess = run.session
    if run.data.val_loader is None or not run.schedule.validates(step):
        return {}
    env = sess.env
    metrics = evaluate(
        sess.recipe,
        run.parallel.wrapped,
        run.data.val_loader,
        sess.autocast,
        env.device,
        env.dp_group,
        env.context_parallel(),
    )
    run.callbacks.on_validation_end(run, step, metrics)  # the logger writes them; early stopping may ask to stop
    return metrics


def objective(result: RunResult, metric: str, required: bool = True) -> Optional[float]:
    """training.objective.metric of the finished run: train/<name> or val/<name>, its last value; when the run has
    none, an error if a sweeper needs it (`required`), else None."""
    split, name = metric.split("/", 1)
    values = result.train if split == "train" else result.val
    if name not in values and not required:
        return None
    if name not in values:
        raise ConfigError(
            f"training.objective.metric={metric}: the run recorded no such value (it has: "
            f"{', '.join(f'{split}/{k}' for k in values) or 'none: ' + split + ' never ran'})"
        )
    return values[name]


if __name__ == "__main__":
    register_configs()  # the schemas, into Hydra's ConfigStore
    launch.run_hydra(main, config_keys)
