"""One function run on every rank of a torchrun job, for a test (tests/helpers.py: run_torchrun).

    torchrun --nproc-per-node N tests/torchrun_worker.py <job.pkl> <out dir>

<job.pkl> holds (fn, args), fn a module-level function of the repository; each rank writes ("ok", fn(*args)) or
("error", its traceback) to <out dir>/rank<RANK>.pkl. A rank that dies of a signal leaves no file; its Python stack
is on stderr (faulthandler)."""

import faulthandler
import os
import pickle
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(job: str, out_dir: str) -> int:
    faulthandler.enable()
    fn, args = pickle.loads(Path(job).read_bytes())
    try:
        result = ("ok", fn(*args))
    except BaseException:  # the test reports it, with its traceback
        result = ("error", traceback.format_exc())
    (Path(out_dir) / f"rank{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(result))
    return 0 if result[0] == "ok" else 1


if __name__ == "__main__":
    from core.distributed.launch import exit_process

    exit_process(main(*sys.argv[1:]))  # as train.py leaves: no interpreter teardown after the process group's end
