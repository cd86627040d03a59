"""Which config keys make a run a different experiment.

Keys that change a run's result: the recipe, the seed, the model, the data, the optimizer and schedule,
the global batch, the precision and the fine-tuning settings (which weights train, their learning rates, the LoRA
adapters). A resumed run must keep them (core/checkpointing/changes.py), and in a
multirun sweep they, as overridden, name each job's checkpoint folder (core/distributed/launch.py), so a
sweep run again resumes each configuration's own job.

Everything else may change within one run: training.steps (to extend it), logging, validation, retention
and checkpoint settings, the number of processes and the micro-batch (the loss is the mean over the global
batch, whatever its split), loader workers, and speed options that leave the numbers alone
(model.backend, compile, activation checkpointing, fused kernels), and how an extended run stretches its
learning-rate schedule (scheduler.on_extend: it only matters once training.steps changes).

Which keys on a command line make it another run (`names_run`): those that change the result, the parallel
layout (a resume may change it, DCP reshards, but a user who asks for another layout means a run of its own)
and the weights a run starts from (checkpoint.init_from). They name the command's default checkpoint folder
(core/distributed/launch.py:checkpoint_dir), so the plain command and one with such overrides never share it.
"""

from __future__ import annotations

RESULT_KEYS = (
    "recipe",
    "seed",
    "model.",
    "data.",
    "optim.",
    "scheduler.",
    "precision.",
    "finetune.",
    "training.global_batch_size",
)
NEUTRAL_KEYS = (
    "model.backend",
    "data.num_workers",
    "data.pin_memory",
    "data.decode_on",
    "data.device_decoder",
    "data.decode_threads",
    "optim.fused",
    "scheduler.on_extend",
)
LAYOUT_KEYS = (
    "distributed",
    "distributed.backend",
    "distributed.dp_outer",
    "distributed.dp_shard",
    "distributed.tp",
    "distributed.cp",
)
START_KEYS = ("checkpoint.init_from",)


def changes_result(key: str) -> bool:
    """Whether the dotted config key `key` is one that makes a different experiment."""
    key = key.lstrip("+~")
    if any(key == k or key.startswith(k + ".") for k in NEUTRAL_KEYS):
        return False
    return any(key == k or (k.endswith(".") and key.startswith(k)) or key == k.rstrip(".") for k in RESULT_KEYS)


def names_run(key: str) -> bool:
    """Whether a command line that sets `key` starts a run of its own (see the module's docstring)."""
    key = key.lstrip("+~")
    return changes_result(key) or key in LAYOUT_KEYS or key in START_KEYS
