"""Hugging Face interop of the GPT: `checkpoint.py to-hf` gives a folder LlamaForCausalLM loads with our
logits, `from-hf` brings such a folder back as an init_from input with the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint import main as checkpoint_cli
from core import session
from core.checkpointing.weights import load_weights, read_model_weights
from core.layers.namespace import TORCH_LAYERS
from recipes.gpt.model import GPT
from recipes.registry import get_recipe
from tests.helpers import REPO, train_run, validated_config

transformers = pytest.importorskip("transformers")

SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=96", "model.seq_length=32", "training.micro_batch_size=4",
         "training.global_batch_size=8", "training.steps=3", "training.val_every_n_steps=0", "training.val_at_end=false",
         "data.num_workers=0", "logger.progress_bar=never", "optim.lr=0.05"]  # a large lr: weights far from init


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


def _assert_llama_parity(step: Path, cfg, out: Path) -> None:
    checkpoint_cli(["to-hf", str(step), str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] == cfg.model.tie_embeddings
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(step, cfg, tokens)
    with torch.no_grad():
        theirs = hf(tokens).logits
    relative = ((ours - theirs).abs().max() / ours.abs().max()).item()
    assert ours.std() > 0.01 and relative <= 1e-5, relative  # (distinct logits, not a constant)


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=true"], ["model.fuse_qkv_params=false"]],
                         ids=["untied", "tied", "unfused_qkv"])
def test_to_hf_gives_llama_our_logits(overrides, cache, tmp_path):
    step, cfg = _train(tmp_path, cache, *overrides)
    _assert_llama_parity(step, cfg, tmp_path / "hf")


def test_a_tensor_parallel_checkpoint_exports_the_same_way(cache, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(REPO / "train.py"),
           "--config-name", "gpt_sanity", *SMALL, "distributed.tp=2", f"data.cache_dir={cache}",
           f"checkpoint.path={tmp_path}/ckpt", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = validated_config("gpt_sanity", [*SMALL, "checkpoint.path=unused"])
    _assert_llama_parity(tmp_path / "ckpt" / "step_3", cfg, tmp_path / "hf")


def test_from_hf_brings_back_the_same_weights(cache, tmp_path, capsys):
    step, cfg = _train(tmp_path, cache)
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    checkpoint_cli(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back.safetensors")])
    printed = capsys.readouterr().out
    assert "model.hidden_size=64 model.num_layers=2 model.num_attention_heads=4 model.num_query_groups=2" in printed
    # The printed settings build the model the weights fit; init_from loads them strictly.
    settings = printed.split("train, predict or generate with: ")[1].split()[1:]
    run_cfg = validated_config("gpt_sanity", [*SMALL, *settings, f"checkpoint.init_from={tmp_path}/back.safetensors",
                                              f"data.cache_dir={cache}", "checkpoint.path=unused"])
    with session.start(run_cfg, tmp_path / "load", get_recipe) as s:
        parallel, _ = session.build_model(s, training=False)
        load_weights(parallel, run_cfg.checkpoint.init_from)
        loaded = parallel.full_state_dict()
    original = read_model_weights(step)
    assert set(loaded) == set(original)
    assert all(torch.equal(loaded[k], original[k]) for k in original)


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
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_b", dtype=torch.float32)
    prompt = tokenizer("The whale", return_tensors="pt")
    theirs = model.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    cfg = validated_config("gpt_sanity", [*SMALL, f"data.tokenizer={tmp_path}/hf", f"data.cache_dir={cache}",
                                          f"checkpoint.init_from={step}", "checkpoint.path=unused",
                                          "generate.prompt=The whale", "generate.greedy=true",
                                          "generate.max_new_tokens=20", "generate.stop_at_eod=false"])
    ours = generate.generate(cfg, tmp_path / "gen")[0].text
    assert tokenizer.decode(theirs) == ours


def test_from_hf_refuses_what_our_model_does_not_compute(cache, tmp_path):
    step, _ = _train(tmp_path, cache)
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, named in (({"attention_bias": True}, "attention_bias=True"), ({"model_type": "qwen2"}, "model_type"),
                          ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type")):
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(SystemExit, match=named):
            checkpoint_cli(["from-hf", str(tmp_path / "hf"), str(tmp_path / "x.safetensors")])
    with pytest.raises(SystemExit, match="not empty"):
        checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_te_layers_match_llama(precision, cache, tmp_path):
    """On a GPU: a checkpoint trained with TE layers exports to a Llama whose logits match our TE model's
    (fp32: TF32 matmul rounding on both sides; bf16: both run in bf16)."""
    from core.layers.namespace import get_layers

    step, cfg = _train(tmp_path, cache, "model.backend=te")
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=dtype).cuda().eval()
    model = GPT(cfg.model, 384, get_layers("te"), device="cuda")
    model.load_state_dict(read_model_weights(step), strict=False)  # (TE's _extra_state stays)
    tokens = torch.randint(0, 256, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        ours, theirs = model.eval()(tokens).float(), hf(tokens).logits.float()
    relative = ((ours - theirs).abs().max() / ours.abs().max()).item()
    print(f"TE vs LlamaForCausalLM, {precision}: max |difference| / max |logit| = {relative:.2e}")
    assert relative <= (2e-3 if precision == "fp32" else 3e-2), relative
