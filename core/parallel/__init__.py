"""Data parallelism. `parallelize.py` applies, in order, tensor parallelism (the layers were built split:
core/layers/tensor_parallel.py), activation checkpointing, compilation and sharding; `base.py` is the
interface the loop uses for every backend (`mfsdp.py`, `fsdp2.py`, `ddp.py`)."""
