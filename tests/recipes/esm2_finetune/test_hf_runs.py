"""Our own fine-tuned models through Hugging Face, end to end (recipes/esm2_finetune/hf.py): a tiny ESM-2 trained a
few steps on the shipped sanity task (head and weights away from their init; fp32, model.backend=torch,
model.activation=gelu_erf, HF's GELU) -> `checkpoint.py to-hf` -> transformers' Auto classes give our logits (a
regression's: our de-standardised predictions) within 1e-5 relative, for every task and both poolings; a LoRA run
started from an HF EsmForMaskedLM folder (checkpoint.init_from, the user's path) exports merged and as a PEFT adapter
that peft loads onto the classification model built from that folder, with equal logits; `from-hf` brings the
folder (or the adapter, with --base) back into weights that the recipe's model, built from the settings it prints,
turns into the original step's predictions. Every case trains in this process (train.py's parts), in seconds."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import shlex
from pathlib import Path

import pytest
import torch

from checkpoint import main as checkpoint_cli
from core import session
from core.checkpointing.weights import load_weights, read_model_weights
from core.training.finetune import is_lora
from recipes.esm2 import hf as esm_hf
from recipes.esm2.tokenizer import PAD
from recipes.esm2_finetune import hf as fh
from recipes.esm2_finetune.predictions import outputs
from recipes.registry import get_recipe, hf_weights_reader
from tests.support.helpers import train_run, validated_config

TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
    "model.max_seq_length=64",
    "model.backend=torch",
    "model.activation=gelu_erf",  # HF's GELU: the logits equal to float precision
    "data.tokens_per_pack=128",
    "data.max_sequences_per_pack=8",
    "training.steps=3",
    "training.global_batch_size=2",
    "training.micro_batch_size=2",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "logger.progress_bar=never",
    "scheduler.warmup_steps=1",
    "optim.lr=1e-2",  # a large lr: weights far from init in 3 steps
]
LABELS = {
    "regression": "data.label_columns=[hydrophobic_fraction,net_charge]",
    "classification": "data.label_columns=[charge_class]",
    "multilabel": "data.label_columns=[glyco_motif,cys_pair,proline_rich]",
    fh.RESIDUE: "data.label_columns=[structure]",
}
LORA = ["finetune.mode=lora", "finetune.lora.rank=4", "finetune.lora.alpha=8"]
CASES = [
    ("regression", "mean", "full"),
    ("regression", "cls", "full"),
    ("classification", "mean", "full"),
    ("classification", "cls", "full"),
    ("multilabel", "mean", "full"),
    ("multilabel", "cls", "full"),
    (fh.RESIDUE, "mean", "full"),
    ("regression", "mean", "lora"),
    (fh.RESIDUE, "mean", "lora"),
]
RELATIVE = 1e-5


def task_settings(task: str, pooling: str) -> list[str]:
    return [f"model.task={task}", f"model.pooling={pooling}", LABELS[task]]


def hf_masked_lm_folder(folder: Path) -> Path:
    """What a user starts from: a (tiny, random) EsmForMaskedLM saved by transformers."""
    from transformers import EsmConfig, EsmForMaskedLM

    m = validated_config("esm2_finetune_sanity", [*TINY, "checkpoint.path=unused"]).model
    torch.manual_seed(11)
    EsmForMaskedLM(EsmConfig(**esm_hf.hf_config(m))).save_pretrained(folder, safe_serialization=True)
    return folder


def our_model(cfg, run_dir: Path, init_from: str):
    """The recipe's model of `cfg` (finetune.mode applied, as train.py builds it) with init_from's weights (a Hugging
    Face folder through the recipe's weights_from_hf_folder, as train.py reads it), and the recipe (its config
    resolved)."""
    with session.start(cfg, run_dir, get_recipe) as sess:
        parallel, _ = session.build_model(sess, training=False)
        reader = functools.partial(hf_weights_reader(sess.cfg.recipe), model=sess.cfg.model)
        ignore = sess.cfg.checkpoint.init_ignore_unexpected
        # LoRA adapters a merged folder lacks keep their fresh init (lora_B = 0: no update), as train.py has it
        load_weights(parallel, init_from, ignore_unexpected=ignore, hf_reader=reader, fresh_if_missing=is_lora)
        return parallel.model.eval(), sess.recipe


def packed_sequences(recipe, rows: int = 3) -> list[dict]:
    """The first validation packs (several sequences per row, cropped to model.max_seq_length)."""
    packs = recipe.split("val")
    return [packs[i] for i in range(rows)]


def our_outputs(model, recipe, packs: list[dict]) -> list[torch.Tensor]:
    """Per sequence (in pack order): the head's outputs in what a user reads (regression: the de-standardised
    prediction; else the logits), [K] per sequence or [tokens, K] per residue."""
    found = []
    with torch.no_grad():
        for pack in packs:
            logits = model(pack["tokens"][None], pack["cu_seqlens"][None]).float()[0]
            cu = pack["cu_seqlens"].tolist()
            for slot in range(int((pack["sequences"] >= 0).sum())):
                if recipe.cfg.model.task == fh.RESIDUE:
                    found.append(logits[cu[slot] : cu[slot + 1]])
                elif recipe.cfg.model.task == "regression":
                    found.append(outputs(recipe.cfg.model, logits[slot]))
                else:
                    found.append(logits[slot])
    return found


def hf_logits(model, packs: list[dict]) -> list[torch.Tensor]:
    """The HF model's logits for the same sequences (each pack's slots, padded into one batch)."""
    sequences = []
    for pack in packs:
        cu = pack["cu_seqlens"].tolist()
        sequences += [pack["tokens"][cu[s] : cu[s + 1]] for s in range(int((pack["sequences"] >= 0).sum()))]
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), PAD)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=(ids != PAD).long()).logits.float()
    return [logits[i, : len(s)] if logits.dim() == 3 else logits[i] for i, s in enumerate(sequences)]


def relative_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> float:
    """max |difference| / max |ours| over every sequence's outputs (logged: pytest -rA shows the figures)."""
    assert len(ours) == len(theirs) >= 4
    a, b = torch.cat([t.flatten() for t in ours]), torch.cat([t.flatten() for t in theirs])
    assert a.std() > 1e-3  # distinct outputs, not a constant
    relative = ((a - b).abs().max() / a.abs().max()).item()
    logging.getLogger("test").warning("%s: max |difference| / max |ours| = %.1e", what, relative)
    return relative


def auto_model(folder: Path, task: str, pooling: str):
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    if task == fh.RESIDUE:
        return AutoModelForTokenClassification.from_pretrained(folder).eval()
    remote = pooling == "mean"
    return AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=remote).eval()


def printed_settings(capsys) -> list[str]:
    """from-hf's settings to predict with (after recipe=esm2_finetune); the step folder it wrote said once."""
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("wrote ")]) == 1, out
    return shlex.split(out.split("fine-tune or predict with: ")[1].splitlines()[0])[1:]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> Path:
    return hf_masked_lm_folder(tmp_path_factory.mktemp("base") / "esm2_hf")


@pytest.mark.slow
@pytest.mark.parametrize("task, pooling, mode", CASES)
def test_our_fine_tuned_model_to_hf_and_back(task, pooling, mode, base_folder, tmp_path, capsys):
    start = [f"checkpoint.init_from={base_folder}", *LORA] if mode == "lora" else []
    overrides = [*TINY, *task_settings(task, pooling), *start]
    cfg = validated_config("esm2_finetune_sanity", [*overrides, f"checkpoint.path={tmp_path}/ckpt"])
    train_run(cfg, tmp_path / "run")
    step = tmp_path / "ckpt" / "step_3"
    model, recipe = our_model(cfg, tmp_path / "ours", str(step))
    packs = packed_sequences(recipe)
    ours = our_outputs(model, recipe, packs)

    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    exported = capsys.readouterr().out
    assert ("LoRA merged" in exported) == (mode == "lora")
    hf = auto_model(tmp_path / "hf", task, pooling)
    exported = relative_difference(ours, hf_logits(hf, packs), f"{type(hf).__name__} vs ours")
    assert exported <= RELATIVE, exported
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert list(config["id2label"].values()) == list(recipe.cfg.model.classes)
    # the folder as checkpoint.init_from of a run with the same settings: backbone and head, our outputs
    again, _ = our_model(cfg.copy(), tmp_path / "init_from_hf", str(tmp_path / "hf"))
    loaded = relative_difference(ours, our_outputs(again, recipe, packs), "init_from=<the HF folder> vs ours")
    assert loaded <= RELATIVE, loaded

    # back: the folder -> from-hf -> a step folder; the printed settings build the model that predicts as ours
    checkpoint_cli(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")])
    settings = printed_settings(capsys)
    back_cfg = validated_config("esm2_finetune_sanity", [*TINY, LABELS[task], *settings, "checkpoint.path=unused"])
    back, back_recipe = our_model(back_cfg, tmp_path / "back_run", back_cfg.checkpoint.init_from)
    again = relative_difference(ours, our_outputs(back, back_recipe, packs), "from-hf's step folder vs ours")
    assert again <= RELATIVE, again
    if mode == "lora":
        adapter_round_trip(recipe.cfg, step, base_folder, packs, ours, tmp_path, capsys)


def adapter_round_trip(cfg, step: Path, base_folder: Path, packs, ours, tmp_path: Path, capsys) -> None:
    """to-hf --adapter -> PeftModel.from_pretrained on the HF classification model built from the run's starting
    folder: our logits; the adapter -> from-hf --base -> LoRA weights (unmerged) -> our logits again."""
    from peft import PeftModel

    checkpoint_cli(["to-hf", str(step), str(tmp_path / "adapter"), "--adapter"])
    capsys.readouterr()
    m = cfg.model
    base = base_classification_model(base_folder, tmp_path / "adapter", str(m.task), str(m.pooling), len(m.classes))
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    lora_b = [v for k, v in read_model_weights(step).items() if ".lora_B." in k]
    assert lora_b and all(v.abs().max() > 1e-4 for v in lora_b)  # trained: the adapter changes the logits
    adapted = relative_difference(ours, hf_logits(peft, packs), "PeftModel vs ours")
    assert adapted <= RELATIVE, adapted

    checkpoint_cli(["from-hf", str(tmp_path / "adapter"), str(tmp_path / "lora_back"), "--base", str(base_folder)])
    settings = printed_settings(capsys)
    assert "finetune.mode=lora" in settings and "finetune.lora.rank=4" in settings
    task = str(m.task)
    back_cfg = validated_config("esm2_finetune_sanity", [*TINY, LABELS[task], *settings, "checkpoint.path=unused"])
    back, back_recipe = our_model(back_cfg, tmp_path / "lora_run", back_cfg.checkpoint.init_from)
    assert any(".lora_A." in name for name, _ in back.named_parameters())
    again = relative_difference(ours, our_outputs(back, back_recipe, packs), "from-hf --base (LoRA) vs ours")
    assert again <= RELATIVE, again


def base_classification_model(folder: Path, adapter: Path, task: str, pooling: str, labels: int):
    """The base a PEFT user builds from the HF ESM-2 folder: EsmFor*Classification with num_labels (for mean pooling,
    the class of the hf_mean_pooling.py the adapter folder holds)."""
    from transformers import EsmForSequenceClassification, EsmForTokenClassification

    if task == fh.RESIDUE:
        model_class = EsmForTokenClassification
    elif pooling == "mean":
        spec = importlib.util.spec_from_file_location("adapter_modeling", adapter / fh.MODELING_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model_class = module.Esm2MeanPooledForSequenceClassification
    else:
        model_class = EsmForSequenceClassification
    return model_class.from_pretrained(folder, num_labels=labels).eval()
