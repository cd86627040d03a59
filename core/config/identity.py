"""Which config keys make a run a different experiment.

Keys that change a run's result: the recipe, the seed, the model, the data, the optimizer and schedule,
the global batch and the precision. A resumed run must keep them (core/checkpointing/changes.py), and in a
multirun sweep they, as overridden, name each job's checkpoint folder (core/distributed/launch.py), so a
sweep run again resumes each configuration's own job.

Everything else may change within one run: training.steps (to extend it), logging, validation, retention
and checkpoint settings, the number of processes and the micro-batch (the loss is the mean over the global
batch, whatever its split), loader workers, and speed options that leave the numbers alone
(model.backend, compile, activation checkpointing, fused kernels).
"""

from __future__ import annotations

RESULT_KEYS = ("recipe", "seed", "model.", "data.", "optim.", "scheduler.", "precision.",
               "training.global_batch_size")
NEUTRAL_KEYS = ("model.backend", "data.num_workers", "data.pin_memory", "data.decode_on", "data.device_decoder",
                "data.decode_threads", "optim.fused")


def changes_result(key: str) -> bool:
    """Whether the dotted config key `key` is one that makes a different experiment."""
    key = key.lstrip("+~")
    if any(key == k or key.startswith(k + ".") for k in NEUTRAL_KEYS):
        return False
    return any(key == k or (k.endswith(".") and key.startswith(k)) or key == k.rstrip(".") for k in RESULT_KEYS)
