"""training.cuda_graphs on CPU: what it refuses, before any work, with the key named (the graphs themselves
run on GPUs: tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import re

import pytest
import torch

from core.config.errors import ConfigError
from core.runtime import Machine, resolve
from tests.support.helpers import REPO, run_python, validated_config

GPU = Machine(cuda=True, te=True)
GRAPHS = ["training.cuda_graphs=forward_backward", "checkpoint.path=unused"]


def test_cuda_graphs_on_cpu_are_refused_before_any_work(tmp_path):
    proc = run_python(
        "train.py",
        "--config-name",
        "vit_sanity",
        "training.cuda_graphs=forward_backward",
        f"hydra.run.dir={tmp_path}",
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "training.cuda_graphs=forward_backward needs a CUDA GPU" in proc.stdout + proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_cuda_graphs_mode_names_the_key():
    with pytest.raises(Exception, match="training.cuda_graphs"):
        validated_config("vit_sanity", ["training.cuda_graphs=full", "checkpoint.path=unused"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["distributed=fsdp2"], "needs distributed.backend=mfsdp"),
        (["distributed=ddp", "precision.param_dtype=fp32"], "needs distributed.backend=mfsdp"),
        (["distributed=mfsdp", "precision=fp8", "precision.fp8.recipe=block"], "not block"),
        (["distributed=mfsdp", "precision=fp8", "precision.fp8.recipe=mxfp8"], "not mxfp8"),
        (["distributed=mfsdp", "training.compile=true"], "training.compile=true both take over"),
    ],
)
def test_cuda_graphs_refuse_what_they_do_not_capture(overrides, message):
    cfg = validated_config("vit_base_patch16_224", [*GRAPHS, *overrides])
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, GPU)


def test_cuda_graphs_resolve_for_the_recipes_gpu_config():
    runtime = resolve(validated_config("vit_base_patch16_224", GRAPHS), GPU)
    assert runtime.cuda_graphs and runtime.parallel == "mfsdp" and runtime.param_dtype == torch.bfloat16
    # FP8 with delayed or current scaling, and activation recomputation, are captured too.
    for overrides in (["precision=fp8_delayed"], ["precision=fp8_current"], ["training.activation_checkpointing=true"]):
        assert resolve(validated_config("vit_base_patch16_224", [*GRAPHS, *overrides]), GPU).cuda_graphs, overrides
    assert not resolve(
        validated_config("vit_base_patch16_224", [*GRAPHS[1:], "training.cuda_graphs=none"]), GPU
    ).cuda_graphs


def test_auto_graphs_where_they_apply_and_eager_elsewhere():
    def auto(*overrides, machine=GPU):
        cfg = validated_config("vit_base_patch16_224", ["checkpoint.path=unused", *overrides])
        assert cfg.training.cuda_graphs == "auto"  # the shipped ViT config's choice
        return resolve(cfg, machine)

    assert auto().cuda_graphs and auto().cuda_graphs_auto
    assert not auto(machine=Machine(cuda=False, te=False)).cuda_graphs
    for overrides in (
        ["distributed=fsdp2"],
        ["precision=fp8", "precision.fp8.recipe=block"],
        ["training.compile=true"],
    ):
        assert not auto(*overrides).cuda_graphs, overrides
    assert auto("precision=fp8_delayed").cuda_graphs


# (overrides, dp_size, dp_outer, tp) -> what a graphed run on that mesh is refused for (None: it runs graphed)
MESHES = [
    ([], 1, 1, 1, None),
    ([], 8, 1, 1, None),  # the shipped ViT config: ZeRO-0, every micro-batch free of collectives
    (["distributed.mfsdp.zero_dp_strategy=2"], 1, 1, 1, None),  # one rank runs ZeRO-0 whatever is asked
    (["distributed.mfsdp.zero_dp_strategy=2"], 2, 1, 1, "zero_dp_strategy=0 (not 2): ZeRO-2/3 reduce-scatter"),
    (["distributed.mfsdp.zero_dp_strategy=3"], 4, 1, 1, "zero_dp_strategy=0 (not 3)"),
    (["distributed.mfsdp.zero_dp_strategy=1"], 2, 1, 1, "zero_dp_strategy=0 (not 1)"),
    ([], 1, 1, 2, "needs distributed.tp=1 (not 2)"),
    ([], 4, 2, 1, "needs distributed.dp_outer=1 (not 2)"),
    (["precision=fp8_delayed"], 1, 1, 1, None),
    (["precision=fp8_delayed"], 2, 1, 1, "on 2 data-parallel ranks needs precision.fp8.enabled=false"),
]


@pytest.mark.parametrize("overrides,dp_size,dp_outer,tp,refusal", MESHES)
def test_graphs_on_a_mesh_run_where_no_collective_is_inside_a_micro_batch(overrides, dp_size, dp_outer, tp, refusal):
    """Once the mesh is known, auto runs eagerly where a graphed run would be refused, and forward_backward is
    refused there naming the key and its value; elsewhere both replay graphs."""
    for mode in ("auto", "forward_backward"):
        cfg = validated_config(
            "vit_base_patch16_224", ["checkpoint.path=unused", f"training.cuda_graphs={mode}", *overrides]
        )
        runtime = resolve(cfg, GPU)
        assert runtime.cuda_graphs  # nothing refused before the mesh is known
        if refusal is None:
            assert runtime.on_mesh(cfg, dp_size, dp_outer, tp).cuda_graphs, mode
        elif mode == "auto":
            assert not runtime.on_mesh(cfg, dp_size, dp_outer, tp).cuda_graphs
        else:
            with pytest.raises(ConfigError, match=f"^training.cuda_graphs=forward_backward .*{re.escape(refusal)}"):
                runtime.on_mesh(cfg, dp_size, dp_outer, tp)


class FakeCapture:
    """torch.cuda.CUDAGraph and torch.cuda.graph stood in for on CPU: records which micro-batch calls were
    captured (the real capture: the GPU tests)."""

    def __init__(self, monkeypatch):
        import contextlib

        self.active, self.captured, self.events = False, [], []
        self.replays = []  # ("replay", n) for the n-th replay, ("wait", n) for a wait until it finished
        fake = self

        @contextlib.contextmanager
        def graph(graph, capture_error_mode):
            self.active = True
            try:
                yield
            finally:
                self.active = False

        class Graph:
            def replay(self):  # nothing was recorded
                fake.replays.append(("replay", sum(kind == "replay" for kind, _ in fake.replays) + 1))

        class Event:
            def __init__(self, blocking=False):
                self.replay = None

            def record(self):
                self.replay = fake.replays[-1][1]

            def synchronize(self):
                fake.replays.append(("wait", self.replay))

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "graph", graph)

    def step(self, forward=None):
        """A GraphedForwardBackward over a one-layer model; `forward(capturing)` may replace the recipe's."""
        import contextlib

        from core.parallel.base import Parallel
        from core.training import cuda_graphs

        fake = self

        class Recipe:
            def forward(self, model, batch, training):
                if fake.active:
                    fake.captured.append(step.calls)
                    if forward:
                        forward()
                return {"loss": model(batch["x"]).square()}

        class RecordingParallel(Parallel):
            """Records how each micro-batch is run and when the gradients are reduced."""

            def micro_batch(self, is_last):
                fake.events.append(("micro_batch", is_last))
                return contextlib.nullcontext()

            def reduce_gradients(self):
                fake.events.append(("reduce", step.calls))

        model = torch.nn.Linear(4, 1)
        step = cuda_graphs.GraphedForwardBackward(RecordingParallel(model, model), Recipe(), contextlib.nullcontext)
        return step


BATCH, SCALE = {"x": torch.ones(2, 4)}, torch.tensor(1.0)


def test_replays_wait_for_the_gpu_to_finish_the_one_before_the_previous(monkeypatch):
    """The host queues at most two replays the GPU has not finished (a launch into a full queue blocks in the
    driver and holds up other threads' CUDA calls): each replay from the third on waits for the one two before."""
    capture = FakeCapture(monkeypatch)
    step = capture.step()
    for _ in range(8):  # 2 eager, 1 captured, 5 replays after the capture's own
        step(BATCH, SCALE, is_last=True)
    assert capture.replays == [
        ("replay", 1),
        ("replay", 2),
        ("wait", 1),
        ("replay", 3),
        ("wait", 2),
        ("replay", 4),
        ("wait", 3),
        ("replay", 5),
        ("wait", 4),
        ("replay", 6),
    ]


@pytest.mark.parametrize("accumulation,captured_call", [(1, 3), (2, 3), (3, 4), (8, 3)])
def test_the_graph_comes_from_a_micro_batch_before_the_last_where_steps_accumulate(
    monkeypatch, accumulation, captured_call
):
    """After two eager micro-batches: with one micro-batch per step the next (a step's last) is captured; with
    several, the first that is not its step's last, whose graph then also serves the last ones."""
    capture = FakeCapture(monkeypatch)
    step = capture.step()
    for call in range(1, 13):
        step(BATCH, SCALE, is_last=call % accumulation == 0)
    assert capture.captured == [captured_call]


def test_graphed_micro_batches_never_reduce_and_each_step_reduces_after_its_last(monkeypatch):
    """Eager (warm-up), captured and replayed micro-batches all run as ones that do not reduce gradients (a graph
    records no collective, and every micro-batch must run the same way); the gradients are reduced once per
    step, after its last micro-batch."""
    capture = FakeCapture(monkeypatch)
    step = capture.step()
    for call in range(1, 10):
        step(BATCH, SCALE, is_last=call % 3 == 0)
    # Calls 1-2 eager, 4 captured (the first before a step's last), 5-9 replayed: recording runs no Python, so
    # only the eager and captured micro-batches enter micro_batch().
    assert capture.captured == [4]
    assert capture.events == [
        ("micro_batch", False),
        ("micro_batch", False),
        ("micro_batch", False),
        ("reduce", 3),
        ("micro_batch", False),
        ("reduce", 6),
        ("reduce", 9),
    ]


def test_a_capture_that_fails_says_why_and_what_to_do(monkeypatch):
    """A recipe whose forward reads a GPU value on the host cannot be recorded: the third micro-batch (the
    first after the eager warm-up) stops the run with what failed and how to avoid it. The capture itself is
    simulated here, as torch raises it inside torch.cuda.graph."""
    from core.training import cuda_graphs

    raised = RuntimeError("a device-to-host copy during capture")  # what torch raises is not what is checked

    def host_read():
        raise raised

    capture = FakeCapture(monkeypatch)
    step = capture.step(host_read)
    for _ in range(step.warmup):  # eager: the forward runs outside any capture and does not fail
        step(BATCH, SCALE, is_last=True)
    with pytest.raises(cuda_graphs.CaptureFailed) as failed:
        step(BATCH, SCALE, is_last=True)
    assert capture.captured == [step.warmup + 1]  # the first capture, not a later replay
    assert failed.value.__cause__ is raised  # the original error stays attached for the traceback
    message = str(failed.value)
    # What failed: the capture of the forward and backward, with torch's error by type and text ...
    assert message.startswith("training.cuda_graphs: the micro-batch's forward and backward could not be captured")
    assert "(RuntimeError: a device-to-host copy during capture)" in message
    # ... why, in terms of the recipe's code, and the two ways out.
    assert ".item()" in message and "keep such code out of the recipe's forward and loss" in message
    assert message.endswith("or run with training.cuda_graphs=none")


class _Event:
    """A stand-in CUDA event: records when it was recorded and waited on, in one shared log."""

    def __init__(self, log: list, number: int):
        self.log, self.number = log, number

    def record(self):
        self.log.append(("record", self.number))

    def synchronize(self):
        self.log.append(("wait", self.number))


def test_queue_bound_waits_for_the_oldest_replay_once_full():
    from core.training.cuda_graphs import QueueBound

    log, made = [], []

    def make_event():
        made.append(_Event(log, len(made)))
        return made[-1]

    bound = QueueBound(2, make_event)
    for _ in range(4):
        bound.wait_for_room()
        log.append("replay")
        bound.queued()
    # Two replays queued freely; the third waits for the first to finish, the fourth for the second.
    assert log == [
        "replay",
        ("record", 0),
        "replay",
        ("record", 1),
        ("wait", 0),
        "replay",
        ("record", 2),
        ("wait", 1),
        "replay",
        ("record", 3),
    ]
    assert len(bound.pending) == 2
    with pytest.raises(ValueError, match="ahead=0"):
        QueueBound(0)
