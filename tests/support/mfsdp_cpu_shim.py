"""TEST-ONLY: run Megatron-FSDP 0.6.1 on CPU with gloo, inside a test worker process.

Megatron-FSDP is CUDA-only as installed: it calls torch.cuda.current_device(), creates CUDA streams,
moves tensors with Tensor.cuda() and reduces with PREMUL_SUM, which gloo refuses. Here those entry
points become no-ops on the CPU and the fused divide is switched off, so its sharding, accumulation
and optimizer logic run unchanged and can be checked against a single-process reference. Never import
this outside tests: it breaks real CUDA use in the process that installs it.
"""

from __future__ import annotations

import contextlib

import torch


class _NoEvent:
    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoStream:
    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoEvent()

    def synchronize(self):
        pass


def install() -> None:
    import importlib

    import core.runtime
    from core.config.schema import ParallelBackend

    # (the package re-exports a function named fully_shard, hiding the module of that name)
    fully_shard_module = importlib.import_module("megatron_fsdp.fully_shard")

    torch.cuda.current_device = lambda: 0
    torch.cuda.Stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Event = lambda *args, **kwargs: _NoEvent()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    # gloo has no PREMUL_SUM: divide after the reduction instead of fusing it (in the config class that
    # megatron-fsdp will use, which the product settles first).
    from core.parallel.mfsdp import use_own_ddp_config_if_needed

    use_own_ddp_config_if_needed()
    config_cls = fully_shard_module.DistributedDataParallelConfig
    original_init = config_cls.__init__

    def init_without_div_fusion(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.gradient_reduce_div_fusion = False

    config_cls.__init__ = init_without_div_fusion

    # gloo runs an asynchronous collective on its own threads while Python goes on. On CUDA, stream order keeps
    # Megatron-FSDP's prefetched parameter all-gathers apart from the work issued after them; the no-op streams
    # above drop that order, and a prefetch left in flight beside other work crashed workers now and then
    # (SIGSEGV). Every coalesced all-gather here finishes before its context closes.
    buffer_module = importlib.import_module("megatron_fsdp.param_and_grad_buffer")
    coalescing_manager = buffer_module._coalescing_manager
    buffer_module._coalescing_manager = lambda group=None, device=None, async_ops=False: coalescing_manager(
        group, device, async_ops=False
    )

    # The product refuses mfsdp without CUDA; the shimmed worker is the one place it may run.
    original_resolve = core.runtime.resolve_parallel_backend
    core.runtime.resolve_parallel_backend = lambda backend, machine: (
        ParallelBackend.mfsdp if backend == ParallelBackend.mfsdp else original_resolve(backend, machine)
    )
