"""The GPT recipe: preprocessing round trips, Megatron-Core datasets, the model, and gpt_sanity learning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.data.checks import assert_dataset_deterministic
from core.data.datasets import EpochIndex
from tests.support.helpers import REPO, read_records, run_python, run_python_ranks

DOCS = ["Call me Ishmael.\nSome years ago—never mind how long—", "Ünïcödé: naïve café, 東京, emoji 🐋.", "x"]


def _write_inputs(tmp: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "a.txt").write_text(f"{DOCS[0]}\n\n\n{DOCS[1]}\n\n", encoding="utf-8")
    (tmp / "b.jsonl").write_text(json.dumps({"text": DOCS[2], "id": 1}) + "\n\n", encoding="utf-8")
    pq.write_table(pa.table({"text": DOCS, "n": [1, 2, 3]}), tmp / "c.parquet")
    return [tmp / "a.txt", tmp / "b.jsonl", tmp / "c.parquet"]


@pytest.mark.slow
def test_preprocess_round_trips_text_to_tokens_to_text(tmp_path):
    """txt (paragraphs), jsonl and parquet -> .bin/.idx with the byte tokenizer -> the same text, exactly."""
    from recipes.gpt.preprocess import decode_document

    inputs = _write_inputs(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.gpt.preprocess",
            "--input",
            *map(str, inputs),
            "--output-prefix",
            str(tmp_path / "out" / "corpus"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = [DOCS[0], DOCS[1], DOCS[2], *DOCS]
    meta = json.loads((tmp_path / "out" / "corpus.json").read_text())
    assert meta["documents"] == 6 and meta["tokens"] == sum(len(d.encode()) + 1 for d in expected)
    assert [decode_document(tmp_path / "out" / "corpus", i) for i in range(6)] == expected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["corpus.bin", "corpus.idx", "corpus.json"]
    shown = run_python(
        "-m",
        "recipes.gpt.preprocess",
        "--decode",
        tmp_path / "out" / "corpus",
        "--document",
        "1",
        cwd=REPO,
        timeout=300,
    )
    assert shown.stdout == DOCS[1] + "\n"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    proc = run_python(
        "-m", "recipes.gpt.preprocess", "--input", bad, "--output-prefix", tmp_path / "bad", cwd=REPO, timeout=300
    )
    assert proc.returncode != 0 and "bad.jsonl:2: no text under the key 'text'" in proc.stderr
    assert not list(tmp_path.glob("bad.*.bin")) and not (tmp_path / "bad.bin").exists()  # nothing half-written


def test_a_local_hugging_face_tokenizer_works_too(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from recipes.gpt.preprocess import decode_document, preprocess
    from recipes.gpt.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        DOCS * 20,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf = HFTokenizer(str(folder))
    assert hf.eod == tok.token_to_id("<|endoftext|>") and hf.vocab_size == tok.get_vocab_size()
    inputs = _write_inputs(tmp_path)
    summary = preprocess(inputs[:1], tmp_path / "hf", str(folder))
    assert summary["documents"] == 2 and summary["tokens"] < sum(len(d.encode()) for d in DOCS[:2])  # merges
    assert [decode_document(tmp_path / "hf", i) for i in range(2)] == DOCS[:2]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(str(folder), eod_token="</s>")


def gpt_recipe(overrides: list[str] = ()):
    from recipes.gpt.recipe import GPTRecipe
    from tests.support.helpers import validated_config

    return GPTRecipe(validated_config("gpt_sanity", ["checkpoint.path=unused", *overrides]))


def test_datasets_come_from_megatron_core_and_are_deterministic(tmp_path):
    recipe = gpt_recipe([f"data.cache_dir={tmp_path}/cache", "training.steps=20"])
    data = recipe.build_datasets()
    assert len(data.train) >= 20 * 32 and len(data.val) > 0
    sample = data.train[EpochIndex(0, 5)]
    assert sorted(sample) == ["idx", "labels", "loss_mask", "position_ids", "tokens"]
    assert sample["tokens"].shape == (128,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert torch.equal(sample["position_ids"], torch.arange(128)) and sample["loss_mask"].sum() == 128
    assert recipe.vocab_size == 384  # 258 byte ids, padded to a multiple of 128
    assert_dataset_deterministic(data.train, indices=[EpochIndex(0, 0), EpochIndex(1, 7), EpochIndex(0, 600)])
    assert_dataset_deterministic(data.val)
    text = "".join(chr(t) if t < 128 else "?" for t in sample["tokens"].tolist() if t < 256)
    assert sum(c.isalpha() for c in text) > 60  # English text, not noise
    again = gpt_recipe([f"data.cache_dir={tmp_path}/cache", "training.steps=20"]).build_datasets()
    assert torch.equal(again.train[EpochIndex(0, 5)]["tokens"], sample["tokens"])  # from the cache, the same
    other = gpt_recipe([f"data.cache_dir={tmp_path}/cache", "training.steps=20", "seed=7"]).build_datasets()
    assert not torch.equal(other.train[EpochIndex(0, 5)]["tokens"], sample["tokens"])  # another shuffle


def test_mock_data_masks_do_not_depend_on_the_first_sample_read(tmp_path):
    """Megatron-Core caches one loss mask per dataset, taken from the first sample read after masking that
    sample's pad labels in place: with a pad id the mock data produces, every later sample's mask depended on
    which sample a process (or loader worker) read first, and a resumed run trained on other masks."""

    def dataset():
        return (
            gpt_recipe(
                [
                    f"data.cache_dir={tmp_path}/cache",
                    "data=gpt_mock",
                    "model.vocab_size=64",
                    "model.seq_length=64",
                    "training.steps=4",
                ]
            )
            .build_datasets()
            .train
        )

    in_order, other_first = dataset(), dataset()
    other_first[EpochIndex(0, 9)]
    for i in range(8):
        a, b = in_order[EpochIndex(0, i)], other_first[EpochIndex(0, i)]
        assert torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["loss_mask"], b["loss_mask"]) and a["loss_mask"].sum() == 64, i  # no mask here


def test_model_shapes_parameter_count_and_flops():
    from core.layers.namespace import TORCH_LAYERS

    for tied in (False, True):
        recipe = gpt_recipe([f"model.tie_embeddings={str(tied).lower()}"])
        model = recipe.build_model(TORCH_LAYERS, torch.device("cpu"))
        total = sum(p.numel() for p in model.parameters())
        embedding = model.embedding.weight.numel()
        assert recipe.non_embedding_parameters() == (total if tied else total - embedding)
        logits = model(torch.randint(0, 258, (2, 16)))
        assert logits.shape == (2, 16, 384)
    names = dict(model.named_parameters())
    assert "layers.0.self_attention.layernorm_qkv.weight" in names and "layers.3.layernorm_mlp.fc1_weight" in names
    assert names["layers.0.layernorm_mlp.fc1_weight"].shape == (2 * 352, 128)  # SwiGLU: gate and up
    assert names["layers.0.self_attention.layernorm_qkv.weight"].shape == (128 + 2 * 2 * 32, 128)  # GQA: 2 groups
    s, n, layers, h = 128, recipe.non_embedding_parameters(), 4, 128
    assert recipe.flops_per_sample() == s * (6 * n + 12 * layers * h * s)
    # Causal: a token's logits do not depend on later tokens.
    tokens = torch.randint(0, 258, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 258
    assert torch.allclose(model(tokens)[0, :8], model(changed)[0, :8], atol=1e-5)


@pytest.mark.slow
def test_gpt_sanity_learns_on_two_processes(tmp_path):
    proc = run_python_ranks(  # ranks as torchrun starts them, forked from the test fork server
        2,
        REPO / "train.py",
        "--config-name",
        "gpt_sanity",
        "training.steps=40",
        "training.val_every_n_steps=40",
        "training.log_every_n_steps=10",
        "logger.progress_bar=never",
        f"data.cache_dir={tmp_path}/cache",
        f"hydra.run.dir={tmp_path}/run",
        f"checkpoint.path={tmp_path}/ckpt",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_records(tmp_path / "run")
    train = [r for r in rows if "split" not in r]
    (val,) = [r for r in rows if r.get("split") == "val"]
    assert train[0]["loss"] > 3.0 and train[-1]["loss"] < 0.6 * train[0]["loss"]  # ln(258) = 5.55 at the start
    assert val["perplexity"] < 20 and abs(val["perplexity"] - torch.tensor(val["loss"]).exp().item()) < 1e-3
    assert train[-1]["tokens_per_sec_per_gpu"] == pytest.approx(train[-1]["samples_per_sec_per_gpu"] * 128)


STEPS4 = [
    "training.steps=4",
    "training.log_every_n_steps=1",
    "training.val_at_end=false",
    "training.val_every_n_steps=0",
    "data.num_workers=0",
    "logger.progress_bar=never",
]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.slow
def test_tensor_and_data_parallel_match_one_process(tmp_path):
    """gpt_sanity from the same initial weights: 2 processes at TP=2 (fsdp2 over DTensors, 2 accumulated
    micro-batches), 2 at DP=2 (1 micro-batch each), 4 at DP=2 x TP=2 (2-D shards), 2 at TP=2 with activation
    checkpointing (blocks recomputed in the backward pass) and 1 process (2 micro-batches) give the same
    losses and gradient norms."""
    from tests.support.checkpoint_harness import run_phases
    from tests.support.helpers import run_workers

    runs = {}
    for label, nproc, extra in (
        ("1 process", 1, []),
        ("DP=2", 2, []),
        ("TP=2", 2, ["distributed.tp=2"]),
        ("DP=2 x TP=2", 4, ["distributed.tp=2"]),
        ("TP=2 recomputed", 2, ["distributed.tp=2", "training.activation_checkpointing=true"]),
    ):
        folder = tmp_path / label.replace(" ", "_").replace("=", "")
        phase = {
            "config": "gpt_sanity",
            "run_dir": str(folder),
            "overrides": STEPS4 + extra + [f"data.cache_dir={tmp_path}/cache", f"checkpoint.path={folder}/c"],
        }
        run_workers(nproc, run_phases, [phase])
        rows = read_records(folder)
        runs[label] = {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "split" not in r}
    reference = runs["1 process"]
    assert sorted(reference) == [1, 2, 3, 4]
    for label in ("DP=2", "TP=2", "DP=2 x TP=2", "TP=2 recomputed"):
        assert sorted(runs[label]) == [1, 2, 3, 4]
        for step, (loss, grad_norm) in reference.items():
            print(f"GPT step {step}: 1 process loss {loss!r} grad norm {grad_norm!r}, {label} {runs[label][step]!r}")
            assert _close(runs[label][step][0], loss), (label, step, loss, runs[label][step])
            assert _close(runs[label][step][1], grad_norm), (label, step, grad_norm, runs[label][step])


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_on_other_layouts(tmp_path):
    """A TP=2 checkpoint (GLU fc1 weights and their Adam moments included) resumes at TP=1 x DP=2 and on one
    process, continuing with the TP=2 run's own losses; its to-torch export is the TP=1 layout of the
    weights, equal to what the resumed runs end with."""
    from core.checkpointing.weights import read_model_weights
    from tests.support.checkpoint_harness import run_phases
    from tests.support.helpers import run_workers

    common = STEPS4 + [f"data.cache_dir={tmp_path}/cache", "checkpoint.save_every_n_steps=2"]
    written = run_workers(
        2,
        run_phases,
        [
            {
                "config": "gpt_sanity",
                "run_dir": f"{tmp_path}/tp2",
                "state": True,
                "overrides": common + ["distributed.tp=2", f"checkpoint.path={tmp_path}/a"],
            }
        ],
    )
    tp2 = written[0][0]
    resume = [f"checkpoint.resume={tmp_path}/a/step_2"]
    dp2 = run_workers(
        2,
        run_phases,
        [
            {
                "config": "gpt_sanity",
                "run_dir": f"{tmp_path}/dp2",
                "state": True,
                "overrides": common + resume + [f"checkpoint.path={tmp_path}/b"],
            }
        ],
    )[0][0]
    one = run_workers(
        1,
        run_phases,
        [
            {
                "config": "gpt_sanity",
                "run_dir": f"{tmp_path}/one",
                "state": True,
                "overrides": common + resume + [f"checkpoint.path={tmp_path}/c"],
            }
        ],
    )[0][0]
    for run in (dp2, one):
        assert run["start_step"] == 2 and sorted(run["losses"]) == [3, 4]
        for step in (3, 4):
            assert _close(run["losses"][step], tp2["losses"][step]), (step, run["losses"], tp2["losses"])
    exported = read_model_weights(tmp_path / "a" / "step_4")
    assert sorted(exported) == sorted(tp2["state"]) == sorted(dp2["state"]) == sorted(one["state"])
    fc1 = "layers.0.layernorm_mlp.fc1_weight"
    assert exported[fc1].shape == (2 * 352, 128)
    for name, value in exported.items():
        for run in (tp2, dp2, one):  # full_state_dict gives the TP=1 layout at TP=2 too
            assert torch.allclose(run["state"][name], value, rtol=1e-4, atol=1e-6), name
    # The GLU layout matters: the TP=2 ranks' blocks joined in order differ from [gate; up].
    gate, up = exported[fc1].chunk(2)
    joined = torch.cat([gate[:176], up[:176], gate[176:], up[176:]])
    assert not torch.allclose(joined, exported[fc1])


def test_tensor_parallel_is_refused_where_it_cannot_work():
    from dataclasses import replace

    from core.config.errors import ConfigError
    from core.layers.namespace import TORCH_LAYERS
    from core.layers.tensor_parallel import TensorParallel

    recipe = gpt_recipe(["model.num_query_groups=3", "model.num_attention_heads=6", "model.hidden_size=96"])
    with pytest.raises(ConfigError, match="num_query_groups=3 is not divisible by distributed.tp=2"):
        recipe.build_model(replace(TORCH_LAYERS, tp=TensorParallel(2, 0, object())), torch.device("cpu"))


def test_activation_checkpointing_recomputes_each_block_and_keeps_the_names():
    from core.layers.namespace import TORCH_LAYERS
    from core.parallel import activation_checkpointing

    recipe = gpt_recipe()
    model = recipe.build_model(TORCH_LAYERS, torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    calls = []
    for i, block in enumerate(model.layers):  # count the blocks' computations: a block's attention runs once in each
        block.self_attention.register_forward_hook(lambda *_, _i=i: calls.append(_i))
    assert activation_checkpointing.apply(model, recipe.unit_modules(TORCH_LAYERS), TORCH_LAYERS.checkpoint) == 4
    model(torch.randint(0, 258, (2, 16))).float().square().mean().backward()
    assert calls == [0, 1, 2, 3, 3, 2, 1, 0]  # forward, then each block again during the backward pass
    assert [n for n, _ in model.named_parameters()] == names and all(p.grad is not None for p in model.parameters())


def _glu_layer_step(tmp: str, tp: int):
    """One AdamW step of a biased SwiGLU twin block, sharded by fsdp2 at `tp`, saved with DCP to tmp/tp<tp>."""
    import torch.distributed.checkpoint as dcp

    from core.config.schema import DistributedConfig, ParallelBackend
    from core.distributed import env as distributed
    from core.layers.namespace import TORCH_LAYERS
    from core.layers.torch_twins import TransformerLayer
    from core.layers.weight_init import init_parameters, standard_rule
    from core.parallel.parallelize import parallelize
    from core.runtime import Runtime

    env = distributed.setup(1, -1, tp, 5, "cpu")
    try:
        layer = torch.nn.Sequential(
            TransformerLayer(
                16,
                24,
                4,
                num_gqa_groups=2,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                bias=True,
                activation="swiglu",
                normalization="RMSNorm",
                attn_input_format="bshd",
                **env.tensor_parallel().layer_kwargs(),
            )
        )
        init_parameters(layer, 0, standard_rule(0.5), env.tensor_parallel())
        runtime = Runtime("cpu", ParallelBackend.fsdp2, TORCH_LAYERS.name, None, torch.float32)
        par = parallelize(layer, runtime, env, DistributedConfig(), TORCH_LAYERS, [TransformerLayer])
        optimizer = torch.optim.AdamW([p for _, p in par.named_parameters()], lr=0.1)
        torch.manual_seed(0)
        par.wrapped(torch.randn(2, 5, 16)).square().mean().backward()
        optimizer.step()
        dcp.save(
            {"model": par.model_state_dict(), "optim": par.optimizer_state_dict(optimizer)},
            checkpoint_id=f"{tmp}/tp{tp}",
        )
    finally:
        distributed.teardown()


@pytest.mark.slow
def test_glu_bias_and_its_adam_moments_are_saved_in_the_tp1_layout(tmp_path):
    """A biased SwiGLU block: fc1 weight, fc1 bias and their Adam moments saved at TP=2 equal those saved at TP=1."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from core.checkpointing.layout import empty_like_saved
    from tests.support.helpers import run_workers

    run_workers(1, _glu_layer_step, str(tmp_path), 1)
    run_workers(2, _glu_layer_step, str(tmp_path), 2)
    saved = {}
    for tp in (1, 2):
        metadata = FileSystemReader(f"{tmp_path}/tp{tp}").read_metadata()
        keys = [k for k in metadata.state_dict_metadata if "fc1_" in k and not k.endswith(".step")]
        state = {k: empty_like_saved(metadata, k) for k in keys}
        with pytest.warns(UserWarning, match="load in a single process"):
            dcp.load(state, checkpoint_id=f"{tmp_path}/tp{tp}", no_dist=True)
        saved[tp] = state
    assert sorted(saved[1]) == sorted(saved[2]) and len(saved[1]) == 6  # weight, bias; value, exp_avg, exp_avg_sq
    for key, value in saved[1].items():
        assert torch.allclose(saved[2][key], value, rtol=1e-5, atol=1e-7), key
