"""Process group, device and device mesh: everything the rest of the loop needs to know about ranks.

Works the same under `torchrun`, under SLURM (one task per GPU, e.g. through the submitit launcher)
and as a plain single `python train.py` process (a one-rank process group, so that every backend's
code path is the same at any scale).
"""

from __future__ import annotations

import datetime
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.config.errors import ConfigError
from core.layers.context_parallel import ContextParallel
from core.layers.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

MESH_DIMS = ("dp_outer", "dp_shard", "cp", "tp")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh  # dims ("dp_outer", "dp_shard", "cp", "tp")
    dp_mesh: DeviceMesh  # "dp_outer" x "dp_shard" flattened: the ranks that take different samples
    dp_outer: int
    dp_shard: int
    tp: int
    cp: int = 1
    # "dp_outer" x "dp_shard" x "cp" flattened: the ranks that hold different tokens of the batch, over which the
    # loss is counted and gradients are reduced (the data-parallel ranks without context parallelism).
    dp_cp_mesh: Optional[DeviceMesh] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.dp_outer * self.dp_shard

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp

    @property
    def dp_cp_rank(self) -> int:
        return (self.dp_cp_mesh or self.dp_mesh).get_local_rank()

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        return (self.dp_cp_mesh or self.dp_mesh).get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.mesh["cp"].get_group()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    def context_parallel(self) -> ContextParallel:
        if self.cp == 1:
            return ContextParallel()
        ranks = tuple(int(r) for r in self.mesh["cp"].mesh.flatten().tolist())
        return ContextParallel(self.cp, self.cp_rank, self.cp_group, ranks)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh["tp"].get_group()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    def tensor_parallel(self) -> TensorParallel:
        return TensorParallel(self.tp, self.tp_rank, self.tp_group if self.tp > 1 else None)


def _export_slurm_env_if_needed() -> None:
    """Under `srun python train.py` or the submitit launcher (one task per GPU, no torchrun), derive
    RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT from SLURM's variables."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    from submitit.slurm.slurm import SlurmJobEnvironment  # parses SLURM_JOB_NODELIST

    job = SlurmJobEnvironment()
    os.environ.update(
        RANK=str(job.global_rank),
        WORLD_SIZE=str(job.num_tasks),
        LOCAL_RANK=str(job.local_rank),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", job.hostnames[0]),
        # The same port on every task of the job, derived from the job id.
        MASTER_PORT=os.environ.get("MASTER_PORT", str(20000 + zlib.crc32(job.job_id.encode()) % 40000)),
    )


_STORE: Optional[dist.Store] = None
_JOBS_STARTED = 0
_DEVICE_BOUND_WORLD_STARTED = False


def _job_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The key-value store for this job's process group.

    A Hydra multirun starts one process group per job in the same processes. Each job gets its own
    key prefix in one store kept for the life of the process: otherwise a job could read keys (such
    as peer addresses) left behind by the previous job and hang.
    """
    global _STORE, _JOBS_STARTED
    if _STORE is None:
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            _STORE = dist.HashStore()  # a plain `python train.py`: no network needed
        else:
            # Under torchrun, its agent already serves the store; otherwise rank 0 hosts it.
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            _STORE = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world_size,
                is_master=rank == 0 and not agent,
                timeout=timeout,
            )
    _JOBS_STARTED += 1
    return dist.PrefixStore(f"recipes/job{_JOBS_STARTED}", _STORE)


def mesh_shape(world_size: int, dp_outer: int, dp_shard: int, tp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """Resolve -1 entries and check that the mesh covers the world exactly: (dp_outer, dp_shard, cp, tp)."""
    sizes = {"distributed.dp_outer": dp_outer, "distributed.dp_shard": dp_shard, "distributed.cp": cp}
    sizes["distributed.tp"] = tp
    unknown = [k for k, v in sizes.items() if v == -1]
    for k, v in sizes.items():
        if v == 0 or v < -1:
            raise ConfigError(f"{k}={v}: mesh sizes must be positive (or -1 for 'the rest')")
    if len(unknown) > 1:
        raise ConfigError(f"only one of {', '.join(unknown)} may be -1")
    known = 1
    for v in sizes.values():
        known *= v if v != -1 else 1
    if unknown:
        if world_size % known:
            raise ConfigError(
                f"{unknown[0]}=-1: world size {world_size} is not divisible by the other mesh sizes "
                f"({' x '.join(f'{k}={v}' for k, v in sizes.items() if v != -1)})"
            )
        sizes[unknown[0]] = world_size // known
    product = 1
    for v in sizes.values():
        product *= v
    if product != world_size:
        names = " x ".join(k.removeprefix("distributed.") for k in sizes)
        raise ConfigError(
            f"device mesh {names} = {' x '.join(str(v) for v in sizes.values())} = {product}, "
            f"but the world size is {world_size} (processes launched); make them multiply to {world_size}"
        )
    return (
        sizes["distributed.dp_outer"],
        sizes["distributed.dp_shard"],
        sizes["distributed.cp"],
        sizes["distributed.tp"],
    )


def setup(dp_outer: int, dp_shard: int, tp: int, timeout_minutes: float, device_type: str, cp: int = 1) -> DistEnv:
    """Start the process group (NCCL on CUDA, gloo on CPU) on `device_type` (core/runtime.py decides it), pick
    this rank's device, build the mesh."""
    _export_slurm_env_if_needed()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Validate the mesh before touching any device or process group.
    dp_outer, dp_shard, cp, tp = mesh_shape(world_size, dp_outer, dp_shard, tp, cp)

    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        global _DEVICE_BOUND_WORLD_STARTED
        # Only this process's first NCCL world is bound to the device (NCCL starts at once and the mesh's groups
        # are split from it): torch's NCCL backend crashes (SIGSEGV in split_group, pytorch/pytorch#191952) when a
        # bound world that is not the process's first NCCL group splits. A later job in the same processes (the
        # next of a Hydra multirun, tests that run several) starts its NCCL lazily and makes its groups anew.
        bind = device_type == "cuda" and not _DEVICE_BOUND_WORLD_STARTED
        dist.init_process_group(
            backend,
            store=_job_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if bind else None,
        )
        _DEVICE_BOUND_WORLD_STARTED = _DEVICE_BOUND_WORLD_STARTED or bind
    mesh = init_device_mesh(device_type, (dp_outer, dp_shard, cp, tp), mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["dp_outer", "dp_shard"]._flatten("dp")
    dp_cp_mesh = None
    if cp > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # what FSDP shards over (core/parallel/)
        dp_cp_mesh = mesh["dp_outer", "dp_shard", "cp"]._flatten("dp_cp")
    return DistEnv(rank, world_size, local_rank, device, mesh, dp_mesh, dp_outer, dp_shard, tp, cp, dp_cp_mesh)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
