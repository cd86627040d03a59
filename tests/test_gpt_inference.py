"""The GPT after training: generate.py (KV cache against recomputation, seeds, the text is the model's) and
per-document perplexity through predict.py on 2 processes."""

from __future__ import annotations

import csv
import json
import math
import subprocess
from collections import OrderedDict

import pytest
import torch

import generate
from core.checkpointing.weights import read_model_weights
from core.layers.namespace import TORCH_LAYERS
from recipes.gpt.model import GPT
from tests.helpers import REPO, compose_config, run_python, torchrun, train_run, validated_config

STEPS = 80


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """gpt_sanity on Moby Dick for 80 steps in one process (validation perplexity ~10 per byte)."""
    tmp = tmp_path_factory.mktemp("gpt")
    cfg = validated_config("gpt_sanity", [f"training.steps={STEPS}", f"training.val_every_n_steps={STEPS}",
                                          "logger.progress_bar=never", "data.num_workers=0",
                                          f"data.cache_dir={tmp}/cache", f"checkpoint.path={tmp}/ckpt"])
    train_run(cfg, tmp / "run")
    return tmp


def _generate(tmp, run: str, *overrides: str) -> list[generate.Generation]:
    cfg = compose_config("gpt_sanity", [f"checkpoint.init_from={tmp}/ckpt/step_{STEPS}", f"data.cache_dir={tmp}/cache",
                                        "generate.prompt='Call me Ishmael. '", f"checkpoint.path={tmp}/unused", *overrides])
    return generate.generate(cfg, tmp / run)


@pytest.mark.slow
def test_greedy_with_the_kv_cache_equals_recomputing(trained):
    """300 new tokens: the text outgrows the 128-token context twice, so the cache is also refilled."""
    cached = _generate(trained, "kv", "generate.greedy=true", "generate.max_new_tokens=300")
    recomputed = _generate(trained, "no_kv", "generate.greedy=true", "generate.max_new_tokens=300",
                           "generate.kv_cache=false")
    assert cached[0].new_tokens == 300 and cached[0].stop == "length"
    assert cached[0].text == recomputed[0].text
    saved = [json.loads(line) for line in (trained / "kv" / "generations.jsonl").read_text().splitlines()]
    assert saved == [vars(cached[0])]


@pytest.mark.slow  # trains the fixture's model
def test_a_seed_gives_the_same_samples_and_the_text_is_the_models(trained):
    sample = ["generate.temperature=1.0", "generate.max_new_tokens=120", "generate.samples_per_prompt=2",
              "generate.stop_at_eod=false"]
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
            logits = model(tokens[:, :-1])[0, len(prompt) - 1:]
        return torch.nn.functional.cross_entropy(logits, tokens[0, len(prompt):]).item()

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
    base = [REPO / "generate.py", "--config-name", "gpt_sanity",
            f"checkpoint.init_from={trained}/ckpt/step_{STEPS}", f"data.cache_dir={trained}/cache",
            f"hydra.run.dir={tmp_path}/run", "generate.max_new_tokens=40"]
    proc = run_python(*base, f"generate.prompt_file={prompts}", "generate.greedy=true", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--- prompt 1 (length, 40 tokens)\nThe whale" in proc.stdout and "--- prompt 2" in proc.stdout
    assert len((tmp_path / "run" / "generations.jsonl").read_text().splitlines()) == 2
    bad = run_python(*base, "generate.top_p=1.5", "generate.prompt=x", cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "generate.top_p=1.5: expected 0 < top_p <= 1" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_per_document_perplexity_on_two_processes(trained, tmp_path):
    cmd = torchrun(2, "predict.py",
           "--config-name", "gpt_sanity", f"checkpoint.init_from={trained}/ckpt/step_{STEPS}", "predict.split=val",
           "predict.micro_batch_size=64", f"data.cache_dir={trained}/cache", f"hydra.run.dir={tmp_path}/run",
           "predict.output=perplexity.csv")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
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
