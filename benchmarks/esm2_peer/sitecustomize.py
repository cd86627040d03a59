"""Loaded by Python at start-up when this folder is on PYTHONPATH (run.sh puts it there): with PEER_METRICS_JSONL
set, every dict the peer passes to wandb.log is also appended to that file as one JSON line, at full precision (its
console lines round to 3 digits). wandb.init replaces wandb.log, so the wrapper is put back after each init."""

import json
import os

PATH = os.environ.get("PEER_METRICS_JSONL")


def _recording(log):
    def record(data, step=None, *args, **kwargs):
        row = {"step": step}
        for key, value in dict(data).items():
            try:
                row[key] = float(value)
            except (TypeError, ValueError):
                row[key] = repr(value)
        with open(PATH, "a") as f:
            f.write(json.dumps(row) + "\n")
        return log(data, step, *args, **kwargs)

    record.recording = True
    return record


if PATH:
    import wandb

    _init = wandb.init

    def _init_then_record(*args, **kwargs):
        run = _init(*args, **kwargs)
        if not getattr(wandb.log, "recording", False):
            wandb.log = _recording(wandb.log)
        return run

    wandb.init = _init_then_record
    wandb.log = _recording(wandb.log)
