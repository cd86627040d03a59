"""The GPT after training: generate.py (KV cache against recomputation, seeds, the text is the model's) and
per-document perplexity through predict.py on 2 processes."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict

import pytest
import torch

import generate
from core.checkpointing.weights import read_model_weights
from core.layers.namespace import TORCH_LAYERS
from recipes.gpt.model import GPT
from tests.support.helpers import REPO, compose_config, run_python, run_python_ranks, train_run, validated_config

# A tiny GPT of gpt_sanity's byte tokenizer: for tests of how generate.py runs, not of its text.
TINY_GPT = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=64",
    "model.seq_length=32",
]


def _tiny_weights(path, nan: bool = False):
    """TINY_GPT's weights drawn at random, as a .safetensors (which holds no settings: give TINY_GPT with it)."""
    from safetensors.torch import save_file

    cfg = validated_config("gpt_sanity", TINY_GPT + ["checkpoint.path=unused"])
    torch.manual_seed(0)
    state = {
        k: v.contiguous()
        for k, v in GPT(cfg.model, 384, TORCH_LAYERS).state_dict().items()
        if not k.endswith("_extra_state")
    }
    if nan:  # one weight every position's output goes through
        state["layers.0.self_attention.proj.weight"][0, 0] = float("nan")
    save_file(state, str(path))
    return path


STEPS = 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """gpt_sanity on Moby Dick for 60 steps in one process (validation perplexity ~11 per byte)."""
    tmp = tmp_path_factory.mktemp("gpt")
    cfg = validated_config(
        "gpt_sanity",
        [
            f"training.steps={STEPS}",
            f"training.val_every_n_steps={STEPS}",
            "logger.progress_bar=never",
            "data.num_workers=0",
            f"data.cache_dir={tmp}/cache",
            f"checkpoint.path={tmp}/ckpt",
        ],
    )
    train_run(cfg, tmp / "run")
    return tmp


def _generate(tmp, run: str, *overrides: str) -> list[generate.Generation]:
    cfg = compose_config(
        "gpt_sanity",
        [
            f"checkpoint.init_from={tmp}/ckpt/step_{STEPS}",
            f"data.cache_dir={tmp}/cache",
            "generate.prompt='Call me Ishmael. '",
            f"checkpoint.path={tmp}/unused",
            *overrides,
        ],
    )
    return generate.generate(cfg, tmp / run)


@pytest.mark.slow
def test_greedy_with_the_kv_cache_equals_recomputing(trained):
    """300 new tokens: the text outgrows the 128-token context twice, so the cache is also refilled."""
    cached = _generate(trained, "kv", "generate.greedy=true", "generate.max_new_tokens=300")
    recomputed = _generate(
        trained, "no_kv", "generate.greedy=true", "generate.max_new_tokens=300", "generate.kv_cache=false"
    )
    assert cached[0].new_tokens == 300 and cached[0].stop == "length"
    assert cached[0].text == recomputed[0].text
    saved = [json.loads(line) for line in (trained / "kv" / "generations.jsonl").read_text().splitlines()]
    assert saved == [cached[0].record()] and "messages" not in saved[0]


@pytest.mark.slow  # trains the fixture's model
def test_a_seed_gives_the_same_samples_and_the_text_is_the_models(trained):
    sample = [
        "generate.temperature=1.0",
        "generate.max_new_tokens=120",
        "generate.samples_per_prompt=2",
        "generate.stop_at_eod=false",
    ]
    a = _generate(trained, "a", *sample, "generate.seed=7")
    b = _generate(trained, "b", *sample, "generate.seed=7")
    c = _generate(trained, "c", *sample, "generate.seed=8")
    assert [g.text for g in a] == [g.text for g in b]
    assert a[0].text != a[1].text and a[0].text != c[0].text
    # The sampled bytes' mean NLL under the model: far below that of uniformly random bytes (ln 256 = 5.5
    # for a model that knew nothing; the model finds random bytes even less likely than that).
    cfg = validated_config("gpt_sanity", ["checkpoint.path=unused"])
    model = GPT(cfg.model, 384, TORCH_LAYERS)
    model.load_state_dict(read_model_weights(trained / "ckpt" / f"step_{STEPS}"), strict=False)
    model.eval()

    def mean_nll(continuation: list[int]) -> float:
        prompt = list("Call me Ishmael. ".encode())
        tokens = torch.tensor([prompt + continuation])
        with torch.no_grad():
            logits = model(tokens[:, :-1])[0, len(prompt) - 1 :]
        return torch.nn.functional.cross_entropy(logits, tokens[0, len(prompt) :]).item()

    generated = mean_nll(list(a[0].text.encode()))
    random_bytes = mean_nll(torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(0)).tolist())
    assert generated < 3.0 < 5.0 < random_bytes, (generated, random_bytes)


def test_the_twin_kv_cache_continues_several_tokens_at_a_time():
    """A prefill of 5 tokens then a step of 3: the same logits as one pass over all 8 (the bottom-right
    causal mask of the step's queries over the cached keys)."""
    cfg = validated_config("gpt_sanity", ["checkpoint.path=unused"])
    torch.manual_seed(0)
    model = GPT(cfg.model, 384, TORCH_LAYERS).eval()
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_kv_cache(2, 16, torch.float32)
        cache.pre_step(OrderedDict({0: 5, 1: 5}))
        first = model(tokens[:, :5], kv_cache=cache)
        cache.pre_step(OrderedDict({0: 3, 1: 3}))
        second = model(tokens[:, 5:], kv_cache=cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_generate_command_prints_a_continuation_and_refuses_bad_input(trained, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The whale"}) + "\n" + json.dumps({"prompt": "Queequeg"}) + "\n")
    base = [
        REPO / "generate.py",
        "--config-name",
        "gpt_sanity",
        f"checkpoint.init_from={trained}/ckpt/step_{STEPS}",
        f"data.cache_dir={trained}/cache",
        f"hydra.run.dir={tmp_path}/run",
        "generate.max_new_tokens=40",
    ]
    proc = run_python(*base, f"generate.prompt_file={prompts}", "generate.greedy=true", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stdout.split("--- prompt 1\nThe whale")[1].split("\n--- (length, 40 tokens)\n--- prompt 2\nQueequeg")
    assert len(first) == 2 and "\n--- (length, 40 tokens)" in first[1]
    assert len((tmp_path / "run" / "generations.jsonl").read_text().splitlines()) == 2
    bad = run_python(*base, "generate.top_p=1.5", "generate.prompt=x", cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "generate.top_p=1.5: expected 0 < top_p <= 1" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_per_document_perplexity_on_two_processes(trained, tmp_path):
    proc = run_python_ranks(
        2,
        REPO / "predict.py",
        "--config-name",
        "gpt_sanity",
        f"checkpoint.init_from={trained}/ckpt/step_{STEPS}",
        "predict.split=val",
        "predict.micro_batch_size=64",
        f"data.cache_dir={trained}/cache",
        f"hydra.run.dir={tmp_path}/run",
        "predict.output=perplexity.csv",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "perplexity.csv") as f:
        rows = list(csv.DictReader(f))
    # One row per validation document, in the split's order; each its own perplexity.
    assert [int(r["document"]) for r in rows] == list(range(len(rows))) and len(rows) > 50
    sequences = [int(r["sequence"]) for r in rows]
    assert sequences == sorted(sequences) and len(set(sequences)) == len(rows)
    for r in rows:
        assert float(r["perplexity"]) == pytest.approx(math.exp(float(r["nll"]) / int(r["tokens"])), rel=1e-5)
    metrics = json.loads((tmp_path / "prediction_metrics.json").read_text())  # beside the CSV
    tokens = sum(int(r["tokens"]) for r in rows)
    assert metrics["rows"] == len(rows) and metrics["tokens"] == tokens
    assert metrics["perplexity"] == pytest.approx(math.exp(sum(float(r["nll"]) for r in rows) / tokens), rel=1e-5)
    assert 3 < metrics["perplexity"] < 20  # learned (258 for a model that knew nothing)


@pytest.mark.slow
def test_a_stopped_generation_keeps_what_it_finished_and_the_same_command_continues_it(tmp_path):
    """SIGTERM to generate.py over 300 prompts: it stops after the continuation in progress, its output holds
    the uninterrupted run's first lines byte for byte, and it says how to continue; a torn last line (a kill -9
    while writing) is dropped, and the same command completes the file to the uninterrupted run's."""
    train_run(
        validated_config(
            "gpt_sanity",
            [
                *TINY_GPT,
                "training.micro_batch_size=4",
                "training.global_batch_size=4",
                "training.steps=2",
                "training.val_every_n_steps=0",
                "training.val_at_end=false",
                "data.num_workers=0",
                "logger.progress_bar=never",
                f"data.cache_dir={tmp_path}/cache",
                f"checkpoint.path={tmp_path}/ckpt",
            ],
        ),
        tmp_path / "train",
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Prompt {i}: {'call me Ishmael ' * (i % 3)}\n" for i in range(300)))
    settings = [
        f"checkpoint.init_from={tmp_path}/ckpt/step_2",
        f"generate.prompt_file={prompts}",
        "generate.max_new_tokens=3",
        "generate.samples_per_prompt=2",
        "generate.temperature=0.8",
        f"checkpoint.path={tmp_path}/unused",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's tiny matrices: more threads only wait on one another
    try:
        generate.generate(
            compose_config("gpt_sanity", settings + [f"generate.output={tmp_path}/ref.jsonl"]), tmp_path / "ref"
        )
    finally:
        torch.set_num_threads(threads)
    reference = (tmp_path / "ref.jsonl").read_bytes().splitlines(keepends=True)
    assert len(reference) == 600

    output = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        str(REPO / "generate.py"),
        "--config-name",
        "gpt_sanity",
        *settings,
        f"generate.output={output}",
        f"hydra.run.dir={tmp_path}/run",
    ]

    def run(name: str, stop_after_lines: int = 0) -> tuple[int, str]:
        with open(tmp_path / name, "w") as log:
            proc = subprocess.Popen(
                command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
            deadline = time.time() + 300
            while stop_after_lines and not (output.exists() and output.read_bytes().count(b"\n") >= stop_after_lines):
                assert proc.poll() is None and time.time() < deadline, (tmp_path / name).read_text()[-3000:]
                time.sleep(0.05)
            if stop_after_lines:
                proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
        return proc.returncode, (tmp_path / name).read_text()

    code, log = run("stopped.log", stop_after_lines=20)
    lines = output.read_bytes().splitlines(keepends=True)
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert 20 <= len(lines) < 600 and lines == reference[: len(lines)]
    assert (
        f"stopped by SIGTERM: {len(lines) // 2} of 300 prompts done ({len(lines)} continuations in {output}); "
        "to continue after them, run the same command again"
    ) in log
    with output.open("ab") as f:  # a process killed while writing the next line
        f.write(reference[len(lines)][:30])
    code, log = run("continued.log")
    assert code == 0, log[-3000:]
    assert f"holds {len(lines)} of 600 continuations already: continuing after them" in log
    assert output.read_bytes() == b"".join(reference)


@pytest.mark.parametrize("greedy", [True, False])
def test_non_finite_logits_are_one_line_naming_the_prompt(tmp_path, caplog, greedy):
    """A checkpoint with a NaN weight: exit code 4 and one line naming the prompt and the checkpoint (sampling
    ended in a traceback; greedy decoding wrote the token of a NaN logit)."""
    from core import session

    weights = _tiny_weights(tmp_path / "nan.safetensors", nan=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The whale\nQueequeg\n")
    cfg = compose_config(
        "gpt_sanity",
        [
            f"checkpoint.init_from={weights}",
            *TINY_GPT,
            f"generate.greedy={greedy}",
            f"generate.prompt_file={prompts}",
            f"checkpoint.path={tmp_path}/unused",
        ],
    )
    with caplog.at_level("ERROR"), pytest.raises(SystemExit) as stopped:
        session.exit_on_error(generate.generate, cfg, tmp_path / "run")
    assert stopped.value.code == 4
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"prompt 1 ('The whale'): the model's logits for new token 1 hold NaN; the weights of "
        f"checkpoint.init_from={weights} hold NaN/Inf or their values overflow (0 continuations before it are in "
        f"{tmp_path}/run/generations.jsonl)"
    ]
