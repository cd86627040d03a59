"""Data and tensor parallelism. `parallelize.py` applies, in order, tensor parallelism, activation
checkpointing, compilation and sharding; `base.py` is the interface the loop uses for every backend
(`mfsdp.py`, `fsdp2.py`, `ddp.py`); `tensor_parallel.py` maps tensor-parallel pieces to full tensors."""
