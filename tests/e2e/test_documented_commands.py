"""Commands as README.md, docs/gpt.md and docs/data.md print them, run in order the way a newcomer runs them, checked
against what the documents say happens (a documented command that misleads is a failing test). Only what the
documents leave to the reader is shortened: training.steps, validation and loader workers, which neither change
what a run trains nor which checkpoint folder it uses."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from core.checkpointing.layout import complete_checkpoints
from core.distributed.launch import run_name
from tests.support.helpers import REPO, read_records, run_python, run_python_ranks, torchrun

SHORT = ["logger.progress_bar=never", "data.num_workers=0", "training.val_at_end=false"]


def _ok(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def _run_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / ".hydra").is_dir())


@pytest.mark.slow
def test_readme_quick_start_then_the_shard_command_then_more_steps_then_predict(tmp_path):
    """README: `vit_sanity`, then its shard command: the shard run is a run of its own, in its own folder, said at its
    start (not "resuming from outputs/vit_sanity/checkpoints/step_300, but these settings
    differ"); `training.steps` raised continues the plain run in its run directory; predict.py finds its config in
    the checkpoint (no --config-name needed)."""

    def train(*overrides: str) -> str:
        return _ok(run_python(REPO / "train.py", "--config-name", "vit_sanity", *overrides, *SHORT, cwd=tmp_path))

    plain = tmp_path / "outputs" / "vit_sanity" / "checkpoints"
    plain_out = train("training.steps=2")
    (first_run,) = _run_dirs(plain.parent)
    shards = tmp_path / "digits_shards"
    _ok(
        run_python(
            REPO / "scripts" / "shard_images.py",
            "--root",
            REPO / "data" / "digits",
            "--out",
            shards,
            "--samples-per-shard",
            "600",
            cwd=tmp_path,
        )
    )
    sharded = ["data=shards", f"data.root={shards}", "data.num_classes=10"]  # README's command
    out = train(*sharded, "training.steps=2")
    own = plain.parent / run_name(sharded)  # data.num_classes@10+data.root@%2F...%2Fdigits_shards+data@shards
    assert f"checkpoints: {own.relative_to(tmp_path)}/checkpoints, a run of its own" in out
    assert "resuming from" not in out and (own / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert (
        "checkpoints: outputs/vit_sanity/checkpoints (vit_sanity's own folder: the same command again resumes the "
        "run)" in plain_out
    )
    (shard_run,) = _run_dirs(own)  # its run directory beside its checkpoints
    assert json.loads((own / "checkpoints" / "run.json").read_text())["run_dir"] == str(shard_run)
    out = train(*sharded, "training.steps=2")  # the same command again: its own run, resumed, nothing to do
    assert (
        f"the checkpoint {own.relative_to(tmp_path)}/checkpoints/step_2 is at step 2 of 2: nothing left to do. To "
        "train this run longer, raise training.steps"
        in out
        and "checkpoint.path=<a new folder>" in out
    )
    # README: "with training.steps=600 it continues from step 300, in the same run directory".
    out = train("training.steps=3")
    assert "resumed from outputs/vit_sanity/checkpoints/step_2 (step 2" in out
    assert _run_dirs(plain.parent) == [first_run]
    assert [r["step"] for r in read_records(first_run) if "loss" in r and "split" not in r][-1] == 3
    # A resume with another data setting in a folder given explicitly stays refused, saying how to start a new run.
    proc = run_python(
        REPO / "train.py",
        "--config-name",
        "vit_sanity",
        *sharded,
        "training.steps=4",
        f"checkpoint.path={plain}",
        *SHORT,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "give it a folder of its own: checkpoint.path=<a new folder>" in proc.stdout
    # README's predict command without --config-name: the checkpoint names its config.
    out = _ok(
        run_python(
            REPO / "predict.py",
            "checkpoint.init_from=outputs/vit_sanity/checkpoints",
            "predict.split=val",
            cwd=tmp_path,
        )
    )
    assert "--config-name vit_sanity: the config outputs/vit_sanity/checkpoints/step_3 was trained with" in out
    assert "wrote 359 rows to" in out


@pytest.mark.slow
def test_gpt_md_tensor_parallel_after_gpt_sanity_trains_then_generate_without_a_config(tmp_path):
    """gpt.md: `gpt_sanity`, then `gpt_sanity distributed.tp=2`: the second trains (a run of its own), not
    "distributed.tp: 1 -> 2 ... nothing left to do"; generate.py takes the config from the checkpoint."""
    _ok(run_python(REPO / "train.py", "--config-name", "gpt_sanity", "training.steps=1", *SHORT, cwd=tmp_path))
    proc = run_python_ranks(
        2,
        REPO / "train.py",
        "--config-name",
        "gpt_sanity",
        "distributed.tp=2",
        "training.steps=1",
        *SHORT,
        cwd=tmp_path,
    )
    out = _ok(proc)
    assert "nothing left to do" not in out and "step 1 | loss" in out and "mesh dp_outer=1 x dp_shard=1 x tp=2" in out
    assert "checkpoints: outputs/gpt_sanity/distributed.tp@2/checkpoints, a run of its own" in out
    assert [p.name for p in complete_checkpoints(tmp_path / "outputs/gpt_sanity/distributed.tp@2/checkpoints")] == [
        "step_1"
    ]
    out = _ok(
        run_python(
            REPO / "generate.py",
            "checkpoint.init_from=outputs/gpt_sanity/distributed.tp@2/checkpoints",
            'generate.prompt="The whale"',
            "generate.max_new_tokens=4",
            cwd=tmp_path,
        )
    )
    assert (
        "--config-name gpt_sanity: the config outputs/gpt_sanity/distributed.tp@2/checkpoints/step_1 was trained with"
        in out
        and "--- prompt 1\nThe whale" in out
        and "\n--- (length, 4 tokens)" in out
    )


@pytest.mark.slow
def test_entry_points_without_a_config_answer_in_one_line(tmp_path):
    """`python train.py` alone, `--help`, and predict.py given no checkpoint: the configs to choose from, not a
    traceback, Hydra's struct errors or its schema names."""
    proc = run_python(REPO / "train.py", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    shipped = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem != "train_defaults")
    assert {"esm2_sanity", "gpt_sanity", "mnist_pretrain", "vit_predict", "vit_sanity"} <= set(shipped)
    assert proc.stderr.strip().splitlines() == [
        f"config error: train.py needs a config: --config-name <name>, one of {', '.join(shipped)}"
    ]
    proc = run_python(REPO / "train.py", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(
        "usage: python train.py --config-name <name> [key=value ...]"
    )
    assert "vit_sanity" in proc.stdout and "_schema" not in proc.stdout and "== Config ==" not in proc.stdout
    proc = run_python(REPO / "predict.py", "predict.split=val", cwd=tmp_path)
    assert proc.returncode == 2 and "(or checkpoint.init_from=<step folder" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_python(REPO / "predict.py", f"checkpoint.init_from={tmp_path}/model.pt", cwd=tmp_path)
    assert (
        proc.stderr.strip().splitlines()
        == [f"config error: checkpoint.init_from={tmp_path}/model.pt: no such file or folder"]
        and proc.returncode == 2
    )
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_another_recipes_data_and_an_unresolvable_value_are_one_line_config_errors(tmp_path):
    proc = run_python(REPO / "train.py", "--config-name", "vit_sanity", "data=moby_dick", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "config error: data=moby_dick is data of the gpt recipe, but this config trains the vit recipe: choose "
        "data=<one of digits, imagefolder, shards, synthetic, tiny_imagenet>, or a config of the gpt recipe "
        "(--config-name)"
    ]
    proc = run_python(
        REPO / "train.py",
        "--config-name",
        "vit_sanity",
        "checkpoint.path=${oc.env:NO_SUCH_VARIABLE}",
        cwd=tmp_path,
        env={"PATH": "/usr/bin"},
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].endswith(
        "config error: invalid config at 'checkpoint.path': KeyError raised while resolving "
        "interpolation: \"Environment variable 'NO_SUCH_VARIABLE' not found\""
    )


# --- Every shell block of README.md and docs/*.md, run in order as a newcomer reads them ---------------------------

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # README first: the pages build on its runs
NOT_RUN = re.compile(r"<!-- not run by tests/e2e/test_documented_commands\.py: (.+?) -->")
SHELL_FENCE = re.compile(r"```(bash|sh|shell)\s*$")
# Parts of a command the test does not run, and why (the suite runs in the environment they make).
SETUP = {
    ("python3", "-m", "venv"): "the environment is installed",
    (".",): "the environment is installed",
    ("pip", "install"): "the environment is installed (network)",
    ("python", "-m", "pytest"): "the suite itself",
}
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
QUIET = ("CUDA_HOME", "Apex", "Transformer Engine and Apex", "TransformerEngine is not installed")


@dataclass
class Block:
    page: Path
    line: int
    lines: list[str]
    not_run: str | None  # the reason the page gives, or None


def shell_blocks(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if SHELL_FENCE.match(lines[i]):
            end = lines.index("```", i + 1)
            before = next((x for x in reversed(lines[:i]) if x.strip()), "")
            reason = NOT_RUN.fullmatch(before.strip())
            blocks.append(Block(page, i + 1, lines[i + 1 : end], reason.group(1) if reason else None))
            i = end
        i += 1
    return blocks


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, the output lines the block shows after it): `\\` continuations joined, `# ...` lines after a
    command are its output."""
    joined: list[str] = []
    for line in block.lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line)
    found: list[tuple[str, list[str]]] = []
    for line in joined:
        if line.startswith("#"):
            if found:
                found[-1][1].append(line[1:].strip())
        elif line.strip():
            found.append((line, []))
    return found


def expected_line(text: str, numbers_exact: bool) -> re.Pattern:
    """A line the docs show, as a pattern: `...` and `<placeholder>` stand for anything, a decimal number for any
    number (metrics and timings differ from run to run), a whole number for itself unless the test shortened the
    run (then for any number)."""
    out = []
    for piece in re.split(r"(\.\.\.|<[^<>]+>)", text):
        if piece == "..." or (piece.startswith("<") and piece.endswith(">")):
            out.append(".*?")
            continue
        pos = 0
        for m in re.finditer(NUMBER, piece):
            out.append(re.escape(piece[pos : m.start()]))
            whole = re.fullmatch(r"\d[\d,]*", m.group())
            out.append(re.escape(m.group()) if whole and numbers_exact else NUMBER)
            pos = m.end()
        out.append(re.escape(piece[pos:]))
    return re.compile("".join(out))


class Reader:
    """Runs the pages' commands in one folder (the repository's files linked into it), in order."""

    def __init__(self, work: Path):
        self.work = work
        for entry in REPO.iterdir():
            if entry.name not in {"outputs", "multirun", "ckpts", "ckpt", ".git", ".venv"}:
                (work / entry.name).symlink_to(entry)
        # The docs' /tmp/ as a folder of its own, with a short name: a run's folder name holds its data.root
        self.tmp = Path(tempfile.mkdtemp(prefix="docs", dir="/tmp"))
        self.skipped: list[str] = []

    def fill(self, token: str) -> str:
        """Placeholders and paths the docs name as a reader would have them: /tmp/ a folder of this test's,
        `<date_time>` the newest training run's directory, a step folder of a run the test shortened its newest step."""
        token = token.replace("/tmp/", f"{self.tmp}/")
        if "<date_time>" in token:
            parent = self.work / token.split("<date_time>")[0]
            runs = [p for p in parent.iterdir() if (p / "metrics.jsonl").is_file()]  # training's, not predict's
            token = str(max(runs, key=lambda p: p.name))
        step = re.search(r"(?:^|=)([^=]*?/)step_\d+", token)
        if step and not (self.work / token.split("=")[-1].split("/config.yaml")[0]).exists():
            folder = self.work / step.group(1)
            steps = complete_checkpoints(folder) if folder.is_dir() else []  # none: a folder the command writes
            if steps:
                newest = max(steps, key=lambda p: int(p.name.split("_")[1]))
                token = re.sub(r"step_\d+", newest.name, token)
        return token

    def prepare(self, argv: list[str]) -> None:
        """What the docs tell the reader to have: vit.md's `predict.folder=new` is 5 digits of data/digits/val and an
        empty (unreadable) image file."""
        if "predict.folder=new" in argv and not (self.work / "new").exists():
            (self.work / "new").mkdir()
            for source in sorted((REPO / "data" / "digits" / "val").glob("*/*.png"))[:5]:
                shutil.copy(source, self.work / "new" / source.name)
            (self.work / "new" / "empty.png").touch()

    def run(self, command: str, shows: list[str], where: str) -> None:
        for part in _split_and(shlex.split(command, comments=True)):
            reason = next((why for start, why in SETUP.items() if tuple(part[: len(start)]) == start), None)
            if reason:
                self.skipped.append(f"{where}: `{' '.join(part)}` ({reason})")
                continue
            argv = [self.fill(t) for t in part]
            shortened = "train.py" in argv and not any(a.startswith("training.steps=") for a in argv)
            if shortened:
                argv.append("training.steps=2")
            self.prepare(argv)
            output = self._execute(argv, where)
            lines = output.splitlines()
            for text in shows:
                text = text.replace("%2Ftmp%2F", quote(f"{self.tmp}/", safe="")).replace("/tmp/", f"{self.tmp}/")
                pattern = expected_line(text, numbers_exact=not shortened)
                at = next((i for i, line in enumerate(lines) if pattern.search(line)), None)
                assert at is not None, (
                    f"{where}: `{command}` printed no line like\n  {text}\nit printed:\n{output[-4000:]}"
                )
                lines = lines[at + 1 :]
            noisy = [line for line in output.splitlines() if any(q in line for q in QUIET)]
            assert not noisy, f"{where}: `{command}` warned on a CPU: {noisy}"
            notes = [line.split(" - ", 1)[-1] for line in output.splitlines() if " - note: " in line]
            assert len(notes) == len(set(notes)), f"{where}: `{command}` repeated a note: {notes}"

    def _execute(self, argv: list[str], where: str) -> str:
        if argv[0] == "torchrun" and "-m" not in argv:
            # Each rank forked from the test's fork server, as torchrun would start it: seconds less per command
            # (torchrun itself is tested in tests/e2e/test_checkpoints.py and test_failing_jobs.py). A sweep (-m)
            # keeps torchrun: its jobs run one after another in the same processes.
            nproc = int(argv[argv.index("--nproc-per-node") + 1])
            script_at = argv.index("--nproc-per-node") + 2
            script = str((self.work / argv[script_at]).resolve())
            proc = run_python_ranks(nproc, script, *argv[script_at + 1 :], cwd=self.work)
        elif argv[0] == "torchrun":
            nproc = int(argv[argv.index("--nproc-per-node") + 1])
            script_at = argv.index("--nproc-per-node") + 2
            proc = subprocess.run(
                torchrun(nproc, argv[script_at], *argv[script_at + 1 :]),
                cwd=self.work,
                capture_output=True,
                text=True,
                timeout=600,
            )
        elif argv[0] in ("python", "python3"):
            args = argv[1:] if argv[1] == "-m" else [str((self.work / argv[1]).resolve()), *argv[2:]]
            proc = run_python(*args, cwd=self.work)
        else:
            raise AssertionError(
                f"{where}: `{' '.join(argv)}`: the test runs python and torchrun commands only; "
                "mark the block with the reason it is not run"
            )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{where}: `{' '.join(argv)}` exited {proc.returncode}:\n{output[-4000:]}"
        return output


def _split_and(tokens: list[str]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for token in tokens:
        parts.append([]) if token == "&&" else parts[-1].append(token)
    return [p for p in parts if p]


def test_every_shell_block_says_whether_it_runs_on_a_cpu_and_why_not():
    blocks = [b for page in PAGES for b in shell_blocks(page)]
    assert len(blocks) > 20
    for block in blocks:
        if block.not_run is None:
            for command, _ in commands(block):
                for part in _split_and(shlex.split(command, comments=True)):
                    assert part[0] in {"python", "python3", "torchrun", ".", "pip"}, (
                        f"{block.page.name}:{block.line}: `{command}`: not a command the test runs; mark the block"
                    )


def test_intra_doc_links_and_anchors_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and an anchor a heading of it."""

    def anchors(page: Path) -> set[str]:
        heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    dead = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                dead.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                dead.append(f"{page.name}: {target}")
    assert not dead, dead


def test_the_config_group_table_lists_every_option():
    """configuration.md's table of groups names every YAML file of configs/<group>/."""
    table = (REPO / "docs" / "configuration.md").read_text()
    for group in ("model", "data", "distributed", "optim", "scheduler", "precision", "logger", "checkpoint"):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{group}` |"))
        missing = [p.stem for p in (REPO / "configs" / group).glob("*.yaml") if f"`{p.stem}`" not in row]
        assert not missing, f"configuration.md's {group} row lacks {missing}"


@pytest.mark.slow
def test_every_cpu_shell_block_of_the_docs_runs_in_order_and_prints_what_they_show(tmp_path):
    """README.md, then docs/*.md: each block not marked `not run` runs, its commands exit 0, print the lines the
    block shows after them, warn of no CUDA_HOME/Apex/TransformerEngine and give each note once."""
    reader = Reader(tmp_path)
    try:
        for page in PAGES:
            for block in shell_blocks(page):
                where = f"{page.relative_to(REPO)}:{block.line}"
                if block.not_run:
                    reader.skipped.append(f"{where} ({block.not_run})")
                    continue
                for command, shows in commands(block):
                    reader.run(command, shows, where)
    finally:
        shutil.rmtree(reader.tmp, ignore_errors=True)
    print("not run:\n" + "\n".join(reader.skipped))
