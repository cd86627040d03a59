"""train.py with one fault injected (tests/e2e/test_failing_jobs.py): FAULT=<name> on rank FAULT_RANK at step FAULT_STEP.

  crash       the rank's process dies (os._exit) in the middle of a step, as a crashed peer does
  log_error   an exception while logging a step, on that rank only
  disk_full   the rank's checkpoint write fails with ENOSPC, as on a full disk
  sigterm     the rank gets SIGTERM once it has logged the step, as from a scheduler ending the job
"""

import errno
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hydra  # noqa: E402

import train  # noqa: E402
from core.checkpointing import storage  # noqa: E402
from core.distributed import launch  # noqa: E402
from recipes.registry import register_configs  # noqa: E402

FAULT = os.environ.get("FAULT", "")
MINE = int(os.environ.get("RANK", "0")) == int(os.environ.get("FAULT_RANK", "1"))
AT_STEP = int(os.environ.get("FAULT_STEP", "3"))

if MINE and FAULT == "crash":
    step_fn = train.train_step

    def train_step(run, step, micro_batches):
        if step == AT_STEP:
            os._exit(9)
        return step_fn(run, step, micro_batches)

    train.train_step = train_step
elif MINE and FAULT == "log_error":
    log_fn = train.log_step

    def log_step(run, step, out):
        if step >= AT_STEP:
            raise OverflowError("injected: a value too large to log")
        return log_fn(run, step, out)

    train.log_step = log_step
elif MINE and FAULT == "sigterm":
    log_fn = train.log_step

    def log_step(run, step, out):
        log_fn(run, step, out)
        if step == AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)

    train.log_step = log_step
elif MINE and FAULT == "disk_full":
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    storage.ChecksummingWriter.write_data = write_data

# train.main's body under a Hydra entry point of this file (Hydra finds configs/ beside the entry's file).
main = hydra.main(version_base="1.3", config_path=str(Path(train.__file__).parent / "configs"),
                  config_name=None)(train.main.__wrapped__)

if __name__ == "__main__":
    register_configs()
    launch.run_hydra(main)
