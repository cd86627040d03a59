"""Several nodes, as far as one machine can show them: docs/clusters.md's per-node script (scripts/slurm/node.sh, what
scripts/slurm/train.sbatch runs on every node) started twice at once as two nodes of 2 CPU workers, whose torchrun
agents meet at a c10d rendezvous as on a cluster; the 4 workers train with HSDP (sharded within a node, replicated
across). SIGTERM to one node's torchrun stops the workers of both nodes at the same step with a checkpoint; the same
command again resumes and ends with the uninterrupted run's losses and checkpoint, bit for bit. train.sbatch's own
steps (the warning, SIGTERM to every node, the requeue) run with stand-ins for SLURM's commands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core.distributed.launch import run_name
from tests.support.checkpoint_harness import TINY, train_losses
from tests.support.helpers import PROCESS_TAG, REPO, free_port, kill_processes, tagged_processes

NODE = REPO / "scripts" / "slurm" / "node.sh"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
STEPS = 40  # a few seconds of training: SIGTERM after step 3 lands well before the end, also on a faster machine
# HSDP: dp_outer=2 replicas (one per node) of a model sharded over dp_shard=-1, the 2 workers of a node. Dropout, so
# that the resumed random state matters too; 3 steps an epoch (48 samples, global batch 16).
ARGS = ["--config-name", "vit_sanity", *TINY, "distributed=fsdp2", "distributed.dp_outer=2"]
ARGS += [f"training.steps={STEPS}", "model.hidden_dropout=0.1"]
START_S = 180  # two agents and 4 workers importing torch on 2 cores take some 40 s
RUN_S = 300


@dataclass
class Launch:
    """One start of the two nodes: each node.sh (torchrun, by exec) and the file its output goes to."""

    nodes: list[subprocess.Popen]
    logs: list[Path]


def _listening(port: int) -> bool:
    """Whether a socket of this machine listens on `port` (read from /proc: no connection made to it)."""
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for line in table.read_text().splitlines()[1:] if table.exists() else []:  # no tcp6 without IPv6
            local, state = line.split()[1], line.split()[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "0A":
                return True
    return False


def _launch(cwd: Path, job_id: str, tag: str) -> Launch:
    """node.sh on two "nodes" of this machine, with the variables SLURM would set (a job of 2 nodes, its id) and the
    rendezvous host given (no scontrol here). The head node starts first and hosts the rendezvous, as the first node
    of a SLURM job does (both would match this machine's name: the first to bind the port would host it)."""
    cwd.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # this Python's torchrun
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": job_id,
        "RDZV_HOST": "127.0.0.1",
        "RDZV_PORT": str(port),
        "NPROC_PER_NODE": "2",
        PROCESS_TAG: tag,  # every process of the launch carries it: none may be left behind
    }
    launch = Launch([], [])
    for node in range(2):
        launch.logs.append(cwd / f"node{node}-{time.monotonic_ns()}.log")
        with open(launch.logs[-1], "w") as log:
            launch.nodes.append(
                subprocess.Popen(
                    [str(NODE), *ARGS], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        if node == 0:
            _wait_for(lambda: _listening(port), launch, "the head node's rendezvous store", START_S)
    return launch


def _output(launch: Launch, node: int) -> str:
    return launch.logs[node].read_text(errors="replace")


def _wait_for(condition, launch: Launch, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [n for n, p in enumerate(launch.nodes) if p.poll() is not None]
        assert not ended, f"node {ended[0]} ended before {what}:\n{_output(launch, ended[0])[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _finish(launch: Launch, tag: str) -> list[tuple[int, str]]:
    """Each node's exit code and output, once both have ended, and no process of the launch is left (workers
    included: torchrun starts them in sessions of their own)."""
    for node, proc in enumerate(launch.nodes):
        try:
            proc.wait(timeout=RUN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {node} did not end within {RUN_S} s:\n{_output(launch, node)[-4000:]}")
    deadline = time.monotonic() + 15
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tagged_processes(tag), "processes left running after both nodes ended"
    return [(proc.returncode, _output(launch, node)) for node, proc in enumerate(launch.nodes)]


def _run_dir(cwd: Path) -> Path | None:
    """The run directory of the command in `cwd`: one for every rank of every node, and for every invocation."""
    found = list((cwd / "outputs" / "vit_sanity").glob("*/*/metrics.jsonl"))
    assert len(found) <= 1, found
    return found[0].parent if found else None


def _losses(cwd: Path) -> dict[int, float]:
    """The training losses by step that the command in `cwd` logged so far ({} before its first, or while rank 0
    writes a line)."""
    run_dir = _run_dir(cwd)
    try:
        return train_losses(run_dir) if run_dir else {}
    except ValueError:  # a line being written
        return {}


def _tracebacks(output: str) -> int:
    """Python tracebacks printed by a process (torchrun's logged ones start with its own prefix)."""
    return output.splitlines().count("Traceback (most recent call last):")


def _checkpoint(step_dir: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def _assert_bitwise_equal(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_bitwise_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, torch.Tensor):
        bits = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]  # NaN == NaN here
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(*bits), path
    else:
        assert a == b, path


@pytest.mark.slow
def test_two_nodes_hsdp_stopped_by_sigterm_to_one_agent_resume_bitwise(tmp_path):
    tag = uuid.uuid4().hex
    ckpt = Path("outputs") / "vit_sanity" / run_name(ARGS[2:]) / "checkpoints"
    try:
        # A: the two nodes, uninterrupted.
        ref = tmp_path / "a"
        (code0, out0), (code1, out1) = _finish(_launch(ref, "nodes-a", tag), tag)
        assert code0 == code1 == 0, (out0 + out1)[-4000:]
        assert "4 ranks on cpu | distributed.backend=fsdp2 | mesh dp_outer=2 x dp_shard=2 x tp=1" in out0 + out1
        expected = _losses(ref)
        assert sorted(expected) == list(range(1, STEPS + 1))

        # B: the same command; SIGTERM to the head node's torchrun once step 3 is logged. The torchrun that hosts
        # the rendezvous store: another node's, once its workers are done, waits for the signalled one in torchrun's
        # exit barrier, which a signalled torchrun never joins (docs/clusters.md), up to 5 minutes unless the
        # store is gone.
        job = tmp_path / "b"
        launch = _launch(job, "nodes-b", tag)
        _wait_for(lambda: len(_losses(job)) >= 3, launch, "step 3", START_S)
        launch.nodes[0].send_signal(signal.SIGTERM)
        (head_code, head_out), (other_code, other_out) = _finish(launch, tag)
        stopped = max(_losses(job))
        assert 3 <= stopped < STEPS
        # Every worker of both nodes stopped after that step, with one checkpoint: the signalled node's workers got
        # SIGTERM from their torchrun, the other node's learnt of it from the end-of-step agreement (their torchrun
        # exits 0 below).
        # Rank 0 is on the head node (the rendezvous numbers nodes by host name, then by torchrun's pid; the head's
        # started first) and learnt of the signal first hand; it ends last, after the save's last writes, so the
        # other node's workers have ended before the head's torchrun, and the store with it, goes.
        assert f"stopping after step {stopped} on SIGTERM; checkpoint saved" in head_out, head_out[-4000:]
        assert (job / ckpt / f"step_{stopped}" / "COMPLETE").is_file()
        # The other node's torchrun saw all its workers exit with 0 (it reports any other exit and fails).
        assert other_code == 0 and _tracebacks(other_out) == 0, other_out[-4000:]
        # The signalled torchrun ends with the signal's exception once its workers have ended by themselves (none
        # killed after its shutdown timeout), and no worker of it printed a traceback.
        signalled = f"SignalException: Process {launch.nodes[0].pid} got signal: 15"  # node.sh's pid: exec'd torchrun
        assert head_code != 0 and signalled in head_out, head_out[-4000:]
        assert "forcefully exiting" not in head_out and _tracebacks(head_out) == 1, head_out[-4000:]

        # The same command again (a requeued SLURM job keeps its id): it resumes and finishes.
        (code0, out0), (code1, out1) = _finish(_launch(job, "nodes-b", tag), tag)
        assert code0 == code1 == 0, (out0 + out1)[-4000:]
        assert f"resumed from {ckpt}/step_{stopped} (step {stopped}" in out0 + out1, (out0 + out1)[-4000:]
        assert _losses(job) == expected  # every step, bit for bit
        _assert_bitwise_equal(
            _checkpoint(job / ckpt / f"step_{STEPS}", tmp_path / "b.pt"),
            _checkpoint(ref / ckpt / f"step_{STEPS}", tmp_path / "a.pt"),
        )  # weights, optimizer state, step counters
    finally:
        kill_processes(tagged_processes(tag))


def test_docs_show_the_slurm_scripts_as_they_are():
    """docs/clusters.md shows train.sbatch and node.sh whole, as the files are (node.sh is what the test above runs);
    both are shell scripts bash can parse, and executable."""
    page = (REPO / "docs" / "clusters.md").read_text()
    for script in (SBATCH, NODE):
        assert f"```bash\n{script.read_text()}```\n" in page, f"docs/clusters.md does not show {script.name} as it is"
        assert os.access(script, os.X_OK), script
        subprocess.run(["bash", "-n", str(script)], check=True)


# Stand-ins for SLURM's commands and for node.sh, for train.sbatch's own logic: srun starts the task on 2 "nodes" and
# notes their pids, scancel signals them, scontrol notes what it was asked (and how many nodes had stopped by then);
# each node notes its arguments and stops on SIGTERM.
FAKES = {
    "bin/srun": 'for node in 0 1; do SLURM_NODEID=$node "$@" & echo $! >> tasks; done; wait',
    "bin/scancel": 'echo "$*" >> scancel.log; kill -s "${1#--signal=}" $(cat tasks)',
    "bin/scontrol": 'echo "$* ($(grep -c stopped nodes.log) nodes stopped)" >> scontrol.log',
    "scripts/slurm/node.sh": "trap 'echo \"$SLURM_NODEID stopped: $*\" >> nodes.log; exit 0' TERM\n"
    'echo "$SLURM_NODEID started" >> nodes.log; while true; do sleep 0.05; done',
}


def test_the_sbatch_script_stops_every_node_at_the_warning_and_requeues(tmp_path):
    """train.sbatch as SLURM runs it, with stand-ins for srun, scancel, scontrol and node.sh: at the warning
    (SIGUSR1 to the script, `--signal=B:USR1@300`) SIGTERM goes to every node's task, and once they have all ended
    the job is requeued."""
    for name, body in FAKES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    tag = uuid.uuid4().hex
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "SLURM_JOB_ID": "77", PROCESS_TAG: tag}
    job = subprocess.Popen(["bash", str(SBATCH), "--config-name", "vit_sanity", "a=b c"], cwd=tmp_path, env=env)
    try:
        nodes = tmp_path / "nodes.log"
        deadline = time.monotonic() + 30
        while not (nodes.exists() and nodes.read_text().count("started") == 2):
            assert job.poll() is None and time.monotonic() < deadline, "the nodes did not start"
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)
        assert job.wait(timeout=30) == 0
    finally:
        kill_processes(tagged_processes(tag))
    assert sorted(nodes.read_text().splitlines()) == [
        "0 started",
        "0 stopped: --config-name vit_sanity a=b c",
        "1 started",
        "1 stopped: --config-name vit_sanity a=b c",
    ]
    assert (tmp_path / "scancel.log").read_text() == "--signal=TERM 77\n"
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77 (2 nodes stopped)\n"
