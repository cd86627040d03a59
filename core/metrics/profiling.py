"""`training.profile`: a torch.profiler trace of a few optimizer steps, to see where a step's time goes.

The steps `start_step .. start_step + steps - 1` are recorded (the step before them warms the profiler
up); in the trace they are the regions ProfilerStep#<step>. Each rank writes
`<run dir>/profile/rank<R>.trace.json` (open it in https://ui.perfetto.dev or chrome://tracing) and
`rank<R>.summary.txt`, the operators and kernels that took the most time.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from core.config.schema import ProfileConfig

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device, first_step: int):
        self.prof = None
        if not cfg.enabled:
            return
        if cfg.start_step < first_step:
            log.warning(
                "training.profile.start_step=%d is before this run's first step %d: nothing is profiled",
                cfg.start_step,
                first_step,
            )
            return
        self.out, self.rank, self.cuda = run_dir / "profile", rank, device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        first, last = cfg.start_step, cfg.start_step + cfg.steps - 1

        def action(step: int) -> ProfilerAction:  # `step`: the loop's step number
            if step == first - 1:
                return ProfilerAction.WARMUP
            if first <= step < last:
                return ProfilerAction.RECORD
            return ProfilerAction.RECORD_AND_SAVE if step == last else ProfilerAction.NONE

        self.prof = profile(
            activities=activities,
            schedule=action,
            on_trace_ready=self._write,
            record_shapes=cfg.record_shapes,
            with_stack=cfg.with_stack,
        )
        # Count like the loop (trace regions are labelled ProfilerStep#<step>), from this run's first step.
        self.prof.step_num, self.prof.current_action = first_step, action(first_step)
        self.prof.start()

    def _write(self, prof) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out / f"rank{self.rank}.trace.json"))
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
        (self.out / f"rank{self.rank}.summary.txt").write_text(table)
        if self.rank == 0:
            log.info("profile written to %s", self.out)

    def step(self) -> None:
        """Call once at the end of every optimizer step."""
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
