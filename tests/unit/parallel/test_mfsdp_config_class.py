"""core/parallel/mfsdp.py gives megatron-fsdp back its own DistributedDataParallelConfig where megatron-core's,
which megatron-fsdp picks up when both are installed, lacks fields megatron-fsdp passes. Tested against the
versions requirements.txt pins, so an upgrade that makes the substitution unneeded (or breaks it) shows here."""

from __future__ import annotations

import dataclasses
import importlib
import sys

from core.parallel.mfsdp import use_own_ddp_config_if_needed

USERS = ("fully_shard", "megatron_fsdp", "param_and_grad_buffer")  # the modules that build the config


def _modules() -> list:
    return [importlib.import_module(f"megatron_fsdp.{name}") for name in USERS]


def _own() -> type:
    return importlib.import_module("megatron_fsdp.distributed_data_parallel_config").DistributedDataParallelConfig


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_megatron_fsdp_ends_with_a_class_that_takes_every_field_it_passes(monkeypatch):
    for module in _modules():
        monkeypatch.setattr(module, "DistributedDataParallelConfig", module.DistributedDataParallelConfig)
    before = [module.DistributedDataParallelConfig for module in _modules()]
    lacking = [cls for cls in before if not _fields(_own()) <= _fields(cls)]
    if sys.version_info < (3, 12):  # megatron-core 0.16.1 (requirements.txt): the case the substitution is for
        assert lacking, "the pinned megatron-core's class now has every field: the substitution can go"
    use_own_ddp_config_if_needed()
    for module, cls in zip(_modules(), before):
        assert module.DistributedDataParallelConfig is (_own() if cls in lacking else cls), module.__name__


def test_a_megatron_core_class_with_every_field_stays_in_use(monkeypatch):
    complete = dataclasses.make_dataclass("CompleteConfig", [(f.name, f.type, f) for f in dataclasses.fields(_own())])
    for module in _modules():
        monkeypatch.setattr(module, "DistributedDataParallelConfig", complete)
    use_own_ddp_config_if_needed()
    assert all(module.DistributedDataParallelConfig is complete for module in _modules())
