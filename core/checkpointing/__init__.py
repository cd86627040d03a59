"""Torch DCP checkpoints. `checkpoint.py` at the top level is the user's entry (CLI and public API).

  layout.py      step folders, the completion marker, verification
  parts.py       the stateful parts a checkpoint holds (model, optimizer, schedule, train state, RNG, FP8)
  rng.py, fp8.py per-rank RNG state and TE's FP8 scaling state as plain tensors
  staging.py     host copies of sharded state for background saves
  retention.py   which checkpoints to keep
  weights.py     model weights only: init_from, plain-file reads, full weights of a step folder
  manager.py     Checkpointer: where to resume from, restore, save, async completion, retention
  conversion.py  DCP <-> .pt / .safetensors
"""
