"""What the loop does with a NaN/Inf loss or gradient norm (`training.on_nonfinite`).

stop: the step is remembered on the device (no host sync per step); `check`, called at log and save
      steps, stops every rank naming the first bad step, so a NaN model is never logged on or saved.
skip: every step is decided at once (a collective and a host sync): the step's gradients are dropped
      and the weights, optimizer and schedule stay put.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from core.config.schema import NonFinitePolicy

log = logging.getLogger("train")


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient norm with training.on_nonfinite=stop."""


class NonFiniteGuard:
    def __init__(self, policy: NonFinitePolicy, device: torch.device):
        self.policy = policy
        # First step whose loss or gradient norm was NaN/Inf (inf: none), kept on the device.
        self.first_bad = torch.full((), float("inf"), device=device)

    def step_may_proceed(self, step: int, finite: torch.Tensor, skipped_so_far: int) -> bool:
        """Whether step `step` may update the weights, given `finite` (a device bool) of this rank."""
        if self.policy == NonFinitePolicy.skip:
            if all_ranks_true(finite):
                return True
            log.warning(
                "step %d: non-finite loss or gradient norm; optimizer step skipped (%d so far)",
                step,
                skipped_so_far + 1,
            )
            return False
        self.first_bad = torch.where(finite | (self.first_bad < step), self.first_bad, step)
        return True

    def check(self) -> None:
        """Raise on every rank if any rank saw a NaN/Inf loss or gradient norm (a collective, a host sync)."""
        first = self.first_bad.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if torch.isfinite(first).item():
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {int(first.item())}; stopping without "
                "saving it. training.on_nonfinite=skip skips an occasional bad step; if the weights "
                "themselves are non-finite (a diverged run, or a checkpoint loaded with "
                "checkpoint.verify_checksums=false), resume from an earlier checkpoint instead"
            )


def all_ranks_true(flag: torch.Tensor) -> bool:
    """One decision for all ranks (a collective and a host sync)."""
    flag = flag.to(torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
