"""train.py with one fault injected (tests/e2e/test_failing_jobs.py): FAULT=<name> on rank FAULT_RANK at step
FAULT_STEP.

crash       the rank's process dies (os._exit) in the middle of a step, as a crashed peer does
log_error   an exception once the step is logged, on that rank only (a callback: training.callbacks)
disk_full   the rank's checkpoint write fails with ENOSPC, as on a full disk
sigterm     the rank gets SIGTERM once it has logged the step, as from a scheduler ending the job (a callback)
"""

import errno
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hydra  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

import train  # noqa: E402
from core.distributed import launch  # noqa: E402
from core.training.callbacks import Callback  # noqa: E402
from recipes.registry import register_configs  # noqa: E402

FAULT = os.environ.get("FAULT", "")
MINE = int(os.environ.get("RANK", "0")) == int(os.environ.get("FAULT_RANK", "1"))
AT_STEP = int(os.environ.get("FAULT_STEP", "3"))


class InjectedFault(Callback):
    """log_error and sigterm, after the run's logger has written step FAULT_STEP (training.callbacks names it)."""

    def on_step_end(self, run, step, micro_batches, record):
        if not (MINE and record):
            return
        if FAULT == "log_error" and step >= AT_STEP:
            raise OverflowError("injected: a value too large to log")
        if FAULT == "sigterm" and step == AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)


def inject() -> None:
    if MINE and FAULT == "crash":
        step_fn = train.train_step

        def train_step(run, step, micro_batches):
            if step == AT_STEP:
                os._exit(9)
            return step_fn(run, step, micro_batches)

        train.train_step = train_step
    elif MINE and FAULT == "disk_full":

        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        FileSystemWriter.write_data = write_data  # under the checksumming writer (core/checkpointing/storage.py)
    elif FAULT in ("log_error", "sigterm"):  # on every rank: the config is the same everywhere
        sys.argv.append("training.callbacks=[tests.support.fault_run.InjectedFault]")


# train.main's body under a Hydra entry point of this file (Hydra finds configs/ beside the entry's file).
main = hydra.main(version_base="1.3", config_path=str(Path(train.__file__).parent / "configs"), config_name=None)(
    train.main.__wrapped__
)

if __name__ == "__main__":
    inject()
    register_configs()
    launch.run_hydra(main)
