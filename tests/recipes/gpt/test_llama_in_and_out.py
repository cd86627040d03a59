"""A Hugging Face Llama into the GPT recipe (checkpoint.init_from=<HF folder>) and back out (to-hf merged with the
chat template, --adapter as a PEFT adapter, from-hf --base), on data/tiny_llama, fp32, the torch twins."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # pinned in requirements.txt: a missing one is an error here, never a skip
from omegaconf import OmegaConf

from core.config.errors import ConfigError
from recipes.gpt.hf import weights_from_hf_folder
from tests.support.helpers import validated_config

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "data/tiny_llama"
# data/tiny_llama's shape (its config.json), on the mock data (no tokenizing), one step.
TINY_SHAPE = [
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "model.norm_epsilon=1e-5",
]
RUN = [
    "data=gpt_mock",
    "training.micro_batch_size=2",
    "training.global_batch_size=2",
    "training.steps=2",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "data.num_workers=0",
    "logger.progress_bar=never",
]
TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


def _llama_logits(folder: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    relative = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"max |difference| / max |logit| = {relative:.1e}")
    assert theirs.std() > 0.1 and relative <= 1e-5, relative  # (distinct logits, not a constant)
    return relative


def _logits_after_setup(tmp: Path, *overrides: str) -> torch.Tensor:
    """The logits of the model a GPT run builds and initialises (train.setup: checkpoint.init_from), before a step."""
    import train
    from core import session
    from recipes.registry import get_recipe

    cfg = validated_config(
        "gpt_sanity", [*TINY_SHAPE, *RUN, f"data.cache_dir={tmp}/cache", f"checkpoint.path={tmp}/ckpt", *overrides]
    )
    with session.start(cfg, tmp / "run", get_recipe) as sess:
        run = train.setup(sess)
        try:
            with torch.no_grad():
                return run.parallel.model.eval()(TOKENS)
        finally:
            run.checkpointer.close()


@pytest.mark.slow
@pytest.mark.parametrize("fuse", ["true", "false"])
def test_a_run_from_a_hf_llama_folder_computes_its_logits(fuse, tmp_path):
    logits = _logits_after_setup(tmp_path, f"checkpoint.init_from={TINY}", f"model.fuse_qkv_params={fuse}")
    _assert_close(logits, _llama_logits(TINY))


def _settings(**changes) -> object:
    keys = dict(item.split("=", 1) for item in TINY_SHAPE)
    settings = {k.removeprefix("model."): json.loads(v) for k, v in keys.items()}
    settings |= {"rotary_base": 10000.0, "tie_embeddings": False, "fuse_qkv_params": True}
    return OmegaConf.create(settings | changes)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"hidden_size": 32}, "model.hidden_size=32 (config.json: hidden_size=64)"),
        ({"num_query_groups": None}, "model.num_query_groups=4 (config.json: num_key_value_heads=2)"),
        ({"vocab_size": 640}, "model.vocab_size=640"),
        ({"rotary_base": 500000.0}, "model.rotary_base=500000.0 (config.json: rope_theta=10000.0)"),
        ({"tie_embeddings": True}, "model.tie_embeddings=True"),
    ],
)
def test_settings_that_differ_from_the_folder_are_named(changes, named):
    with pytest.raises(ConfigError, match=f"checkpoint.init_from=.*{named.replace('(', '.').replace(')', '.')}"):
        weights_from_hf_folder(TINY, _settings(**changes))
    assert weights_from_hf_folder(TINY, _settings(vocab_size=None))["embedding.weight"].shape == (512, 64)


class _Marker:
    """Unpickling this writes a file: proof that a pickle was loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "unpickled"))


def test_pickled_weights_are_refused_unread(tmp_path):
    """A folder whose weights are a pytorch_model.bin is refused, naming it, even beside another safetensors file
    (an adapter's); the pickle is never opened."""
    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy(TINY / "config.json", folder)
    marker = tmp_path / "marker"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(marker)))
    shutil.copy(TINY / "model.safetensors", folder / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="no model.safetensors.*pytorch_model.bin"):
        weights_from_hf_folder(folder, _settings())
    assert not marker.exists()


# --- out: to-hf merged and --adapter, and the adapter back with from-hf --base -----------------------------------
LORA_RUN = [
    "model.seq_length=64",
    "training.steps=3",
    "training.micro_batch_size=2",
    "training.global_batch_size=2",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "logger.progress_bar=never",
    "optim.lr=0.05",  # large: the adapters far from their init (B = 0)
    "scheduler.warmup_steps=1",
    "finetune.mode=lora",
    "finetune.lora.rank=4",
    "finetune.lora.alpha=8",
    "finetune.lora.target_modules=[layernorm_qkv,proj]",
]


def _ours(weights: dict, rank: int, alpha: float, targets: list[str], fused: bool = True) -> torch.Tensor:
    """Our model (the twins) with LoRA adapters, loaded with `weights`: its logits on TOKENS."""
    from core.layers.lora import add_lora
    from core.layers.namespace import TORCH_LAYERS
    from recipes.gpt.config import GPTModelConfig
    from recipes.gpt.model import GPT

    cfg = OmegaConf.merge(OmegaConf.structured(GPTModelConfig), _settings(fuse_qkv_params=fused, seq_length=64))
    model = GPT(cfg, 512, TORCH_LAYERS)
    add_lora(model, targets, rank, alpha, 0.0, seed=0)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(TOKENS)


@pytest.fixture(scope="module")
def lora_step(tmp_path_factory) -> Path:
    """A LoRA SFT run from data/tiny_llama on the shipped chat set (gpt_sft_sanity), 3 steps: its last step folder."""
    from tests.support.helpers import train_run

    tmp = tmp_path_factory.mktemp("lora")
    cfg = validated_config("gpt_sft_sanity", [*LORA_RUN, f"checkpoint.path={tmp}/ckpt", f"data.cache_dir={tmp}/c"])
    train_run(cfg, tmp / "run")
    return tmp / "ckpt" / "step_3"


@pytest.mark.slow
def test_to_hf_merges_the_lora_and_keeps_the_chat_template(lora_step, tmp_path, capsys):
    from checkpoint import main as checkpoint_cli
    from core.checkpointing.weights import read_model_weights

    weights = read_model_weights(lora_step)
    b = weights["layers.0.self_attention.layernorm_qkv.lora_B.weight"]
    assert b.abs().max() > 1e-3  # trained: the merge has something to add
    ours = _ours(weights, 4, 8.0, ["layernorm_qkv", "proj"])
    checkpoint_cli(["to-hf", str(lora_step), str(tmp_path / "hf")])
    assert "LoRA merged" in capsys.readouterr().out
    _assert_close(ours, _llama_logits(tmp_path / "hf"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (TINY / name).read_bytes()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    before, after = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (TINY, tmp_path / "hf"))
    assert after.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        before.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == after.eos_token_id


@pytest.mark.slow
def test_the_peft_adapter_gives_our_logits_on_the_hf_base_and_comes_back(lora_step, tmp_path, capsys):
    import peft

    from checkpoint import main as checkpoint_cli
    from core.checkpointing.weights import load_weights_file, read_model_weights

    weights = read_model_weights(lora_step)
    ours = _ours(weights, 4, 8.0, ["layernorm_qkv", "proj"])
    checkpoint_cli(["to-hf", str(lora_step), str(tmp_path / "adapter"), "--adapter"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"] and config["r"] == 4
    assert config["base_model_name_or_path"] == str(TINY.resolve())
    base = transformers.LlamaForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = model(TOKENS).logits
    _assert_close(ours, theirs)
    capsys.readouterr()
    out = tmp_path / "back.safetensors"
    checkpoint_cli(["from-hf", str(tmp_path / "adapter"), str(out), "--base", str(TINY)])
    printed = capsys.readouterr().out
    assert "finetune.lora.rank=4 finetune.lora.alpha=8" in printed and "finetune.head=[]" in printed
    back = load_weights_file(out)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k].float()) for k in weights if "lora" in k)


@pytest.mark.slow
@pytest.mark.parametrize(
    "targets, fused, rank",
    [
        (["q_proj", "k_proj", "v_proj", "o_proj"], True, 6),
        (["q_proj", "v_proj"], True, 4),
        (["q_proj", "k_proj", "v_proj", "o_proj"], False, 6),
        (["o_proj"], True, 2),
    ],
    ids=["qkvo", "qv", "qkvo_unfused", "o"],
)
def test_a_peft_trained_adapter_reads_back_exactly(targets, fused, rank, tmp_path, capsys):
    """An adapter PEFT made (q, k, v with their own A's, random B's) -> from-hf --base -> our model computes PEFT's
    logits: the fused LoRA of rank 2 x len(q, k, v present), or 2 for o_proj alone."""
    import peft

    from checkpoint import main as checkpoint_cli
    from core.checkpointing.weights import load_weights_file

    torch.manual_seed(3)
    base = transformers.LlamaForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    lora = peft.LoraConfig(r=2, lora_alpha=5, target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora).eval()
    with torch.no_grad():
        theirs = model(TOKENS).logits
    model.save_pretrained(str(tmp_path / "adapter"))
    out = tmp_path / "ours.safetensors"
    flags = [] if fused else ["--unfused-qkv"]
    checkpoint_cli(["from-hf", str(tmp_path / "adapter"), str(out), "--base", str(TINY), *flags])
    printed = capsys.readouterr().out
    assert f"finetune.lora.rank={rank} finetune.lora.alpha={5 * rank / 2:g}" in printed
    modules = [m for m, part in (("layernorm_qkv", "q_proj"), ("proj", "o_proj")) if part in targets]
    _assert_close(_ours(load_weights_file(out), rank, 5 * rank / 2, modules, fused), theirs)
