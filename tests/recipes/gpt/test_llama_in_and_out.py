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
