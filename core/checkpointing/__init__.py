"""Torch DCP checkpoints. `checkpoint.py` at the top level is the user's entry (CLI and public API).

layout.py      step folders, the completion marker, verification
dcp_index.py   DCP's index (.metadata) read by PyTorch's weights_only unpickler, its shape checked
storage.py     DCP's reader and writer made safe to load and checksummed
lock.py        one writer per checkpoint path (LOCK)
saved_config.py  a step folder's config.yaml read safely; the model settings predict/generate take from it
changes.py     what a resume may change
parts.py       the stateful parts a checkpoint holds (model, optimizer, schedule, train state, RNG, FP8)
rng.py, fp8.py per-rank RNG state and TE's FP8 scaling state as plain tensors
staging.py     host copies of sharded state for background saves
retention.py   which checkpoints to keep
weights.py     model weights only: init_from, plain-file reads, full weights of a step folder
manager.py     Checkpointer: where to resume from, restore, save, async completion, retention
conversion.py  DCP <-> .pt / .safetensors
output_files.py  weight files written whole (temporary file, renamed) with the umask's permissions
"""
