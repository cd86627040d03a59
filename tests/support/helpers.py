"""Shared test utilities: composing configs, training through train.py's building blocks, running functions in
gloo worker processes, and running the entry-point scripts in processes forked with the training stack imported."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    """The command `torchrun --nproc-per-node <nproc> --master-port <a free port> <repository>/<script> <args>`,
    with this Python's torchrun: a port of its own, as tests run side by side (pytest -n)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        str(REPO / script),
        *args,
    ]


def read_records(run_dir: Path | str) -> list[dict]:
    """A run directory's metrics.jsonl, one record per line."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def register() -> None:
    """What the entry points do before Hydra composes: the schemas and the resolvers."""
    from core.distributed import launch
    from recipes.registry import register_configs

    register_configs()
    launch.register_resolvers()


def compose_config(name: str, overrides: list[str]):
    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def validated_config(name: str, overrides: list[str]):
    from core.config.validation import validate

    return validate(compose_config(name, overrides))


def train_run(cfg, run_dir, full_state: bool = False, callbacks: tuple = ()) -> dict:
    """train.py's run, from its parts, in this process: {"result": RunResult, "state": the full weights
    (full_state=True), "param_groups": [(name, tensors, weight decay)] as optimized}. `callbacks`: observers of
    the run (core/training/callbacks.py)."""
    import train
    from core import session
    from recipes.registry import get_recipe

    with session.start(cfg, Path(run_dir), get_recipe) as sess:
        run = train.setup(sess, callbacks=tuple(callbacks))
        result = train.train(run)
        state = full_state_dict(run.parallel) if full_state else None  # a collective: before teardown
        groups = [(g["name"], len(g["params"]), g["weight_decay"]) for g in run.optimizer.param_groups]
    return {"result": result, "state": state, "param_groups": groups}


def full_state_dict(parallel) -> dict:
    """Unsharded model weights by canonical name (TP=1 layout), on the CPU, on every rank (a collective).

    Each rank sends the pieces it holds with their offsets, the way a checkpoint stores them, so this works
    alike for even (FSDP2) and uneven (Megatron-FSDP) shards and tensor-parallel splits."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from core.layers.tensor_parallel import local_pieces

    out = {}
    for name, value in parallel.model_state_dict().items():
        if not isinstance(value, DTensor):
            out[name] = value.detach().cpu()
            continue
        mine = [(offsets, piece.detach().cpu()) for offsets, piece in local_pieces(value)]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        full = torch.empty(value.shape, dtype=value.dtype)
        for pieces in everyone:
            for offsets, piece in pieces:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
        out[name] = full
    return out


def selected_cases(request, test_name: str) -> list[dict]:
    """The parameters of each case of `test_name` (in the requesting module) that this session runs, in order:
    for a module fixture that computes every selected case in one process (each process pays seconds of
    imports and CUDA start-up) and hands each test its own result."""
    cases = [
        item.callspec.params
        for item in request.session.items
        if item.module is request.module and item.originalname == test_name
    ]
    return [dict(c) for i, c in enumerate(cases) if c not in cases[:i]]


def each_case(fn: Callable, cases: dict) -> dict:
    """Worker body for a shared process: fn(*args) for each {name: args}; a case that raises gives its traceback
    (the others still run)."""
    out = {}
    for name, args in cases.items():
        try:
            out[name] = ("ok", fn(*args))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


def case_result(results: dict, name: str):
    """One case's value from each_case's results, or the test fails with that case's traceback."""
    import pytest

    status, value = results[name]
    if status != "ok":
        pytest.fail(f"{name} failed in the shared worker:\n{value}", pytrace=False)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROCESS_TAG = "RECIPES_TEST_TAG"  # set in a started command's environment: it and every process it starts have it


def tagged_processes(tag: str) -> list[int]:
    """Live processes (zombies left out) whose environment holds PROCESS_TAG=<tag>: a command a test started with
    it, and everything that command started, also once reparented (torchrun's workers run in sessions of their own)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{PROCESS_TAG}={tag}".encode() in environ.read_bytes():
                status = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if status != "Z":
                    found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def kill_processes(pids: list[int]) -> None:
    """SIGKILL each of `pids` that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# Workers fork from a server process that has imported these once, instead of each importing them anew (seconds
# per process). Nothing here touches CUDA: a forked child could not use a CUDA context its parent holds. On machines
# without GPUs tests/support/preloaded.py adds the training stack and the recipes.
FORK_SERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "omegaconf",
    "hydra",
    "tests.support.helpers",
    "tests.support.preloaded",
]


def _fork_server():
    """The multiprocessing context whose processes fork from the one server that imported FORK_SERVER_PRELOAD."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


def _take_callers_context(environ: dict, cwd: str) -> None:
    """In a process forked from the server (started earlier): the caller's environment and directory of now, as a
    fresh process would have them."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    if environ.get("OMP_NUM_THREADS", "").isdigit():  # read by a fresh process at its start, not by torch imported
        torch.set_num_threads(max(1, int(environ["OMP_NUM_THREADS"])))
    # The child's default start method is its parent's, so its data loader's workers would start through a fork
    # server or as fresh interpreters (importing torch, TE, ... for every loader) instead of forks as under
    # torchrun or a plain `python`.
    mp.set_start_method("fork", force=True)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, environ: dict, cwd: str) -> None:
    _take_callers_context(
        {
            **environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        },
        cwd,
    )
    # The machine's cores shared out, as torchrun does (one thread per process there): ranks that each ran as many
    # threads as there are cores would wait on one another's spinning threads, several times slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # A rank that dies of a signal (SIGSEGV in a native library) leaves no result: its Python stack on stderr says
    # where it was.
    faulthandler.enable()
    try:
        results[rank] = ("ok", fn(*args))
    except BaseException:  # report any failure to the parent, with its traceback
        results[rank] = ("error", traceback.format_exc())


def run_workers(world_size: int, fn: Callable, *args) -> list:
    """Run fn(*args) in `world_size` worker processes (a gloo group each); return each rank's value."""
    ctx = _fork_server()
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, dict(os.environ), os.getcwd()))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
        out = []
        for r in range(world_size):
            status, value = results.get(r, ("error", f"rank {r} exited with code {procs[r].exitcode} and no result"))
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{value}")
            out.append(value)
        return out


def _script_worker(argv: list[str], cwd: str, environ: dict, out_path: str, err_path: str) -> None:
    import atexit
    import runpy

    _take_callers_context(environ, cwd)
    for fd, path in ((1, out_path), (2, err_path)):  # as a subprocess with captured output
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:  # an interpreter's meaning of the exit value
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter would run at its exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_python(
    *argv: str, cwd: Path | str = REPO, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python <argv>` (a script path, or "-m", module, args), run as __main__ in a process forked from the test
    fork server, where the training stack is already imported: seconds less than a fresh interpreter per command.
    Its output and exit code come back as subprocess.run(..., capture_output=True, text=True) gives them; past
    `timeout` seconds it is killed (subprocess.TimeoutExpired)."""
    return start_python(*argv, cwd=cwd, env=env).finish(timeout)


class StartedPython:
    """A run_python process handed back while it runs (`pid`: to signal it); `finish` waits for its result."""

    def __init__(self, argv: list[str], cwd: Path | str, env: dict | None):
        import tempfile

        self.argv, self.folder = argv, tempfile.mkdtemp(prefix="run_python-")
        self.out, self.err = f"{self.folder}/stdout", f"{self.folder}/stderr"
        environ = dict(os.environ if env is None else env)
        self.proc = _fork_server().Process(target=_script_worker, args=(argv, str(cwd), environ, self.out, self.err))
        self.proc.start()
        self.pid = self.proc.pid

    def finish(self, timeout: float = 600) -> subprocess.CompletedProcess:
        import shutil

        try:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
                raise subprocess.TimeoutExpired(
                    ["python", *self.argv], timeout, Path(self.out).read_text(), Path(self.err).read_text()
                )
            return subprocess.CompletedProcess(
                ["python", *self.argv],
                self.proc.exitcode,
                Path(self.out).read_text(errors="replace"),
                Path(self.err).read_text(errors="replace"),
            )
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def start_python(*argv: str, cwd: Path | str = REPO, env: dict | None = None) -> StartedPython:
    """run_python's process, started and handed back running."""
    return StartedPython([str(a) for a in argv], cwd, env)


def run_python_ranks(
    world_size: int, *argv: str, cwd: Path | str = REPO, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node <world_size> <argv>` with each rank a run_python process (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT and one thread per core share as torchrun gives them, and one run id for all):
    seconds less than torchrun's fresh interpreters. For tests of what a script does on several processes, not of
    torchrun. The first non-zero exit code, and the ranks' output one after another."""
    import time

    from core.distributed.launch import RUN_ID_ENV

    common = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        RUN_ID_ENV: time.strftime("%Y-%m-%d_%H-%M-%S"),
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
    }
    ranks = [
        start_python(*argv, cwd=cwd, env={**common, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world_size)
    ]
    done = [rank.finish(timeout) for rank in ranks]
    return subprocess.CompletedProcess(
        ["python", *argv],
        next((d.returncode for d in done if d.returncode), 0),
        "".join(d.stdout for d in done),
        "".join(d.stderr for d in done),
    )


class Blocked(Exception):
    """Not an OSError, which the code under test may catch."""


@contextlib.contextmanager
def within(seconds: float):
    """Fail the test (Blocked) instead of hanging, if the code waits on a FIFO; again every second after, if
    the code swallowed the first."""

    def too_slow(signum, frame):
        raise Blocked(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
