"""Hugging Face interop of the GPT: `checkpoint.py to-hf` gives a folder LlamaForCausalLM loads with our
logits, `from-hf` brings such a folder back as an init_from input with the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # pinned in requirements.txt: a missing one is an error here, never a skip
from safetensors.torch import load_file, save_file

from checkpoint import main as checkpoint_cli
from core import session
from core.checkpointing.weights import load_weights, read_model_weights
from core.layers.namespace import TORCH_LAYERS
from recipes.gpt.model import GPT
from recipes.registry import get_recipe
from tests.support.helpers import full_state_dict, run_workers, train_run, validated_config

SMALL = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=96",
    "model.seq_length=32",
    "training.micro_batch_size=4",
    "training.global_batch_size=8",
    "training.steps=3",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "data.num_workers=0",
    "logger.progress_bar=never",
    "optim.lr=0.05",
]  # a large lr: weights far from init


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _train(tmp: Path, cache: Path, *overrides: str) -> tuple[Path, object]:
    cfg = validated_config("gpt_sanity", [*SMALL, f"data.cache_dir={cache}", f"checkpoint.path={tmp}/ckpt", *overrides])
    train_run(cfg, tmp / "run")
    return tmp / "ckpt" / "step_3", cfg


def _our_logits(step: Path, cfg, tokens: torch.Tensor) -> torch.Tensor:
    model = GPT(cfg.model, 384, TORCH_LAYERS)
    model.load_state_dict(read_model_weights(step))
    with torch.no_grad():
        return model.eval()(tokens)


def _assert_llama_parity(step: Path, cfg, out: Path) -> float:
    """Export, load with transformers, compare logits on random tokens; returns max |diff| / max |logit|."""
    checkpoint_cli(["to-hf", str(step), str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == (cfg.model.num_query_groups or cfg.model.num_attention_heads)
    assert config["tie_word_embeddings"] == cfg.model.tie_embeddings and config["vocab_size"] == 384
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(step, cfg, tokens)
    with torch.no_grad():
        theirs = hf(tokens).logits
    relative = ((ours - theirs).abs().max() / ours.abs().max()).item()
    print(f"LlamaForCausalLM vs ours: max |difference| / max |logit| = {relative:.1e}")
    assert ours.std() > 0.01 and relative <= 1e-5, relative  # (distinct logits, not a constant)
    return relative


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.tie_embeddings=true"], ["model.fuse_qkv_params=false"], ["model.num_query_groups=null"]],
    ids=["gqa_untied", "gqa_tied", "unfused_qkv", "mha"],
)
def test_to_hf_gives_llama_our_logits(overrides, cache, tmp_path):
    step, cfg = _train(tmp_path, cache, *overrides)
    _assert_llama_parity(step, cfg, tmp_path / "hf")


def test_a_weights_file_exports_with_its_runs_config(cache, tmp_path):
    """to-hf of a to-safetensors file with --config writes what the step folder gives (here in bf16)."""
    step, _ = _train(tmp_path, cache)
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "from_step")])
    checkpoint_cli(["to-safetensors", str(step), str(tmp_path / "weights.safetensors")])
    with pytest.raises(SystemExit, match="--config"):
        checkpoint_cli(["to-hf", str(tmp_path / "weights.safetensors"), str(tmp_path / "from_file")])
    checkpoint_cli(
        [
            "to-hf",
            str(tmp_path / "weights.safetensors"),
            str(tmp_path / "from_file"),
            "--config",
            str(step / "config.yaml"),
            "--dtype",
            "bfloat16",
        ]
    )
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("from_step", "from_file")]
    assert configs[1]["dtype"] == configs[1]["torch_dtype"] == "bfloat16"
    assert {k: v for k, v in configs[0].items() if "dtype" not in k} == {
        k: v for k, v in configs[1].items() if "dtype" not in k
    }
    assert (tmp_path / "from_file" / "tokenizer.json").read_text() == (
        tmp_path / "from_step" / "tokenizer.json"
    ).read_text()
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("from_step", "from_file"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].bfloat16(), b[k]) for k in a)


def _train_a_rank(overrides: list[str], run_dir: str) -> None:
    train_run(validated_config("gpt_sanity", overrides), run_dir)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_the_same_way(cache, tmp_path):
    run_workers(
        2,
        _train_a_rank,
        [*SMALL, "distributed.tp=2", f"data.cache_dir={cache}", f"checkpoint.path={tmp_path}/ckpt"],
        str(tmp_path / "run"),
    )
    cfg = validated_config("gpt_sanity", [*SMALL, "checkpoint.path=unused"])
    _assert_llama_parity(tmp_path / "ckpt" / "step_3", cfg, tmp_path / "hf")


@pytest.mark.parametrize(
    "overrides,out,flags",
    [
        ([], "back.safetensors", []),
        (["model.fuse_qkv_params=false", "model.num_query_groups=null"], "back_step", ["--unfused-qkv"]),
    ],
    ids=["gqa_fused_to_file", "mha_unfused_to_step_folder"],
)
def test_from_hf_brings_back_the_same_weights(overrides, out, flags, cache, tmp_path, capsys):
    step, cfg = _train(tmp_path, cache, *overrides)
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    capsys.readouterr()
    checkpoint_cli(["from-hf", str(tmp_path / "hf"), str(tmp_path / out), *flags])
    printed = capsys.readouterr().out
    groups = cfg.model.num_query_groups or cfg.model.num_attention_heads
    shape = f"model.hidden_size=64 model.num_layers=2 model.num_attention_heads=4 model.num_query_groups={groups}"
    assert shape in printed
    # The printed settings (init_from, the model's shape, the exported tokenizer) build the model the weights
    # fit; init_from loads them strictly.
    settings = printed.split("train, predict or generate with: ")[1].split()
    assert settings[0] == f"checkpoint.init_from={tmp_path / out}"
    run_cfg = validated_config("gpt_sanity", [*SMALL, *settings, f"data.cache_dir={cache}", "checkpoint.path=unused"])
    with session.start(run_cfg, tmp_path / "load", get_recipe) as sess:
        parallel, _ = session.build_model(sess, training=False)
        load_weights(parallel, run_cfg.checkpoint.init_from)
        loaded = full_state_dict(parallel)
    original = read_model_weights(step)
    assert set(loaded) == set(original)
    assert all(torch.equal(loaded[k], original[k]) for k in original)


def test_from_hf_reads_sharded_safetensors(cache, tmp_path, capsys):
    step, _ = _train(tmp_path, cache)
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    whole = load_file(str(tmp_path / "hf" / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", sharded)
    names = sorted(whole)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):  # two shards, as save_pretrained's max_shard_size makes
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: whole[k] for k in part}, str(sharded / file))
        weight_map |= {k: file for k in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    checkpoint_cli(["from-hf", str(tmp_path / "hf"), str(tmp_path / "whole.safetensors")])
    checkpoint_cli(["from-hf", str(sharded), str(tmp_path / "sharded.safetensors")])
    a, b = load_file(str(tmp_path / "whole.safetensors")), load_file(str(tmp_path / "sharded.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_tokenizer_goes_along(cache, tmp_path):
    """The byte tokenizer becomes a tokenizer.json that Hugging Face reads with our ids; a run trained with
    that (a local Hugging Face tokenizer) exports with its files copied, and greedy generation through
    transformers continues a prompt as generate.py does."""
    import generate

    step, _ = _train(tmp_path / "a", cache)
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Call me Ishmael. \u00dcn\u00efc\u00f8d\u00e9 \u201cquotes\u201d \U0001f40b\n"
    assert tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (256, 257)

    step, _ = _train(tmp_path / "b", cache, f"data.tokenizer={tmp_path}/hf")
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf_b")])
    assert (tmp_path / "hf_b" / "tokenizer.json").read_text() == (tmp_path / "hf" / "tokenizer.json").read_text()
    for folder in ("hf", "hf_b"):  # the ids the tokenizer folder declares (it names no bos token)
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, 256, 257), folder
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_b", dtype=torch.float32)
    prompt = tokenizer("The whale", return_tensors="pt")
    theirs = model.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    cfg = validated_config(
        "gpt_sanity",
        [
            *SMALL,
            f"data.tokenizer={tmp_path}/hf",
            f"data.cache_dir={cache}",
            f"checkpoint.init_from={step}",
            "checkpoint.path=unused",
            "generate.prompt=The whale",
            "generate.greedy=true",
            "generate.max_new_tokens=20",
            "generate.stop_at_eod=false",
        ],
    )
    ours = generate.generate(cfg, tmp_path / "gen")[0].text
    assert tokenizer.decode(theirs) == ours


def test_from_hf_refuses_what_our_model_does_not_compute(cache, tmp_path):
    step, _ = _train(tmp_path, cache)
    hf = tmp_path / "hf"
    checkpoint_cli(["to-hf", str(step), str(hf)])
    config = json.loads((hf / "config.json").read_text())
    for change, named in (
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"model_type": "qwen2"}, "model_type='qwen2'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type='llama3'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"hidden_size": None}, "hidden_size missing"),
        ({"num_hidden_layers": 3}, "it gives 3 layers, the weights hold 2"),
        ({"num_hidden_layers": 2**31 - 1}, "it gives 2147483647 layers, the weights hold 2"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "a quantized model"),
        (
            {"intermediate_size": 128},
            r"other shape: model\.layers\.0\.mlp\.down_proj\.weight \(64, 96\) \(config.json: \(64, 128\)\)",
        ),
        ({"tie_word_embeddings": True}, "lm_head.weight differs"),
    ):
        (hf / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(SystemExit, match=named):
            checkpoint_cli(["from-hf", str(hf), str(tmp_path / "x.safetensors")])
        assert not (tmp_path / "x.safetensors").exists()
    (hf / "config.json").write_text(json.dumps(config))
    weights = load_file(str(hf / "model.safetensors"))
    save_file(weights | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, str(hf / "model.safetensors"))
    with pytest.raises(SystemExit, match=r"unexpected: model\.layers\.0\.self_attn\.q_proj\.bias"):
        checkpoint_cli(["from-hf", str(hf), str(tmp_path / "x.safetensors")])
    with pytest.raises(SystemExit, match="not empty"):
        checkpoint_cli(["to-hf", str(step), str(hf)])
