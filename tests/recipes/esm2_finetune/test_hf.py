"""Fine-tuned ESM-2 models to and from Hugging Face (recipes/esm2_finetune/hf.py), on tiny random HF models in fp32:
EsmFor*Classification folders -> ours -> HF with identical tensors and equal logits, the mean-pooled model's own
modeling file, PEFT LoRA adapters made by peft itself -> ours (one fused LoRA) -> an adapter peft loads with equal
logits, merged = peft's merge_and_unload, and adapters we cannot map refused by name."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.layers.lora import merge_lora_weights
from recipes.esm2 import hf as esm_hf
from recipes.esm2_finetune import hf as fh

H, LAYERS, HEADS = 16, 2, 2
IDS = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 2, 1, 1], [0, 11, 12, 13, 14, 15, 16, 17, 18, 2]])
MASK = (IDS != 1).long()


def settings(task: str, classes: list[str], pooling: str = "cls", **more) -> SimpleNamespace:
    """Our model settings (the model section of an esm2_finetune config.yaml) for a tiny model."""
    return SimpleNamespace(**(_base(task, classes, pooling) | more))


def _base(task, classes, pooling):
    return dict(
        hidden_size=H,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        ffn_hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        max_seq_length=64,
        init_std=0.02,
        norm_epsilon=1e-5,
        rotary_base=10000.0,
        token_dropout=True,
        fuse_qkv_params=True,
        activation="gelu_erf",
        task=task,
        classes=classes,
        pooling=pooling,
        target_mean=None,
        target_std=None,
    )


def hf_model(m: SimpleNamespace, seed: int = 0) -> torch.nn.Module:
    """A random EsmForSequenceClassification / EsmForTokenClassification of config.json hf_config(m) (stock classes;
    the mean-pooled one for pooling=mean), biases and norms away from 0 and 1 so that a mix-up shows."""
    from transformers import EsmConfig, EsmForSequenceClassification, EsmForTokenClassification

    from recipes.esm2_finetune.hf_mean_pooling import Esm2MeanPooledConfig, Esm2MeanPooledForSequenceClassification

    config = {k: v for k, v in fh.hf_config(m).items() if k not in ("auto_map", "architectures")}
    torch.manual_seed(seed)
    if config["model_type"] == fh.MEAN_POOLED_MODEL_TYPE:
        model = Esm2MeanPooledForSequenceClassification(Esm2MeanPooledConfig(**config))
    else:
        model = (EsmForTokenClassification if m.task == fh.RESIDUE else EsmForSequenceClassification)(
            EsmConfig(**config)
        )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_folder(model, m: SimpleNamespace, folder: Path) -> None:
    """What `checkpoint.py to-hf` writes (model.safetensors, config.json, the modeling file), from an HF model."""
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    config = fh.hf_config(m)
    (folder / "config.json").write_text(json.dumps(config))
    if config["model_type"] == fh.MEAN_POOLED_MODEL_TYPE:
        fh.write_modeling_file(folder)


CASES = [
    ("regression", ["activity", "stability"], "cls"),
    ("classification", ["cytoplasm", "membrane", "secreted"], "cls"),
    ("multilabel", ["a", "b"], "cls"),
    ("classification", ["no", "yes"], "mean"),
    (fh.RESIDUE, ["H", "E", "C"], "mean"),
]


@pytest.mark.parametrize("task, classes, pooling", CASES)
def test_classification_folders_round_trip_with_identical_tensors_and_equal_logits(
    tmp_path, capsys, task, classes, pooling
):
    """An HF classification folder -> from-hf (the settings it prints) -> ours -> HF: the same tensors; an HF model
    loading them gives the same logits (Auto class, trust_remote_code for mean pooling)."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    m = settings(task, classes, pooling)
    model = hf_model(m)
    save_folder(model, m, tmp_path / "hf")
    printed = fh.import_from_hf(str(tmp_path / "hf"), str(tmp_path / "w.safetensors"))
    assert f"model.task={task}" in printed and f"model.classes={json.dumps(classes).replace(' ', '')}" in [
        shlex.split(s)[0] for s in printed
    ]
    assert (f"model.pooling={pooling}" in printed) == (task != fh.RESIDUE)
    ours = load_file(str(tmp_path / "w.safetensors"))
    assert {k for k in ours if k.startswith("head.")} == set(fh._head_names(task))
    back = fh.classifier_to_hf(ours, m)
    expected = model.state_dict()
    for name, value in back.items():
        if name in expected:
            assert torch.equal(value, expected[name]), name
    missing = set(expected) - set(back)
    assert all(k.startswith("esm.contact_head.") or k.endswith("position_ids") for k in missing), missing
    auto = AutoModelForTokenClassification if task == fh.RESIDUE else AutoModelForSequenceClassification
    loaded = auto.from_pretrained(tmp_path / "hf", trust_remote_code=pooling == "mean" and task != fh.RESIDUE).eval()
    reloaded = type(loaded)(loaded.config).eval()
    reloaded.load_state_dict(back, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS, attention_mask=MASK).logits, model(IDS, attention_mask=MASK).logits)


def test_regression_standardisation_is_folded_into_the_output_layer():
    """HF logits = our predictions, out * std + mean; the import unfolds nothing (mean 0, std 1)."""
    m = settings("regression", ["x", "y"], target_mean=[3.0, -1.0], target_std=[2.0, 0.5])
    torch.manual_seed(0)
    ours = {"head.dense.weight": torch.randn(H, H), "head.dense.bias": torch.randn(H)}
    ours |= {"head.out_proj.weight": torch.randn(64, H), "head.out_proj.bias": torch.randn(64)}  # rows padded to 64
    hf = fh.head_to_hf(ours, m)
    x = torch.randn(5, H)
    pooled = torch.tanh(x @ ours["head.dense.weight"].T + ours["head.dense.bias"])
    prediction = (pooled @ ours["head.out_proj.weight"][:2].T + ours["head.out_proj.bias"][:2]) * torch.tensor(
        [2.0, 0.5]
    )
    prediction += torch.tensor([3.0, -1.0])
    logits = pooled @ hf["classifier.out_proj.weight"].T + hf["classifier.out_proj.bias"]
    torch.testing.assert_close(logits, prediction)
    back = fh.head_from_hf(hf, "regression")["head.out_proj.weight"]
    assert torch.equal(back[:2], hf["classifier.out_proj.weight"]) and back.shape == (64, H) and not back[2:].any()


def test_mean_pooling_pools_the_residues_and_refuses_to_load_without_its_code(tmp_path):
    """The mean-pooled model = the mean of EsmModel's hidden states over the residues (not <cls>, <eos>, padding)
    through the classifier; the Auto classes refuse the folder without trust_remote_code."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    m = settings("classification", ["no", "yes"], "mean")
    model = hf_model(m)
    save_folder(model, m, tmp_path / "hf")
    with torch.no_grad():
        hidden = model.esm(IDS, attention_mask=MASK)[0]
        residues = (MASK.bool() & (IDS != 0) & (IDS != 2)).float()[..., None]
        pooled = (hidden * residues).sum(1) / residues.sum(1)
        c = model.classifier
        expected = c.out_proj(torch.tanh(c.dense(pooled)))
        torch.testing.assert_close(model(IDS, attention_mask=MASK).logits, expected)
        cls_pooled = c.out_proj(torch.tanh(c.dense(hidden[:, 0])))
        assert not torch.allclose(expected, cls_pooled, atol=1e-3)  # the two poolings differ on these weights
    for load in (AutoModelForSequenceClassification.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            load(tmp_path / "hf")


# --- PEFT adapters -------------------------------------------------------------------------------------------------
def peft_model(m: SimpleNamespace, folder: Path, targets, r: int = 4, alpha: int = 8):
    """A MaskedLM base saved to `folder`, and a peft LoRA model on the classification model built from it (as a
    user makes one), lora_B random (non-zero) so that the adapter changes the logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import EsmConfig, EsmForMaskedLM

    torch.manual_seed(1)
    base = EsmForMaskedLM(EsmConfig(**esm_hf.hf_config(m)))
    base.save_pretrained(folder)
    model = hf_model(m)  # (the classification model: base weights loaded below, head random)
    model.esm.load_state_dict(base.esm.state_dict())
    wrapped = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, modules_to_save=["classifier"])
    )
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return wrapped.eval()


def base_model(m: SimpleNamespace, folder: Path):
    """The HF classification model built from the MaskedLM folder (what PeftModel.from_pretrained is given)."""
    model = hf_model(m, seed=7)
    from transformers import EsmForMaskedLM

    model.esm.load_state_dict(EsmForMaskedLM.from_pretrained(folder).esm.state_dict())
    return model.eval()


@pytest.mark.parametrize(
    "targets, rank",
    [(fh.PEFT_TARGETS, 12), (["query", "value"], 8), (["query", "key", "value", "attention.output.dense"], 12)],
)
def test_a_peft_adapter_round_trips_through_ours_with_equal_logits(tmp_path, capsys, targets, rank):
    """peft's adapter (q/k/v LoRAs with their own lora_A) -> from-hf --base -> one fused LoRA of rank 3r (2r for
    query and value) -> to-hf --adapter -> PeftModel.from_pretrained loads it with the original's logits; merged
    (merge_lora_weights) = peft's merge_and_unload."""
    from peft import PeftModel

    m = settings("classification", ["a", "b", "c"])
    wrapped = peft_model(m, tmp_path / "base", targets)
    wrapped.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        original = wrapped(input_ids=IDS, attention_mask=MASK).logits
    printed = fh.import_adapter_from_hf(
        str(tmp_path / "adapter"), str(tmp_path / "base"), str(tmp_path / "w.safetensors")
    )
    assert f"finetune.lora.rank={rank}" in printed and f"finetune.lora.alpha={8 * rank / 4:g}" in printed
    ours = load_file(str(tmp_path / "w.safetensors"))
    assert ours["layers.0.self_attention.layernorm_qkv.lora_A.weight"].shape == (rank, H)
    lora = {"rank": rank, "alpha": 8 * rank / 4, "dropout": 0.0}
    fh.export_adapter(ours, m, lora, tmp_path / "ours")
    loaded = PeftModel.from_pretrained(base_model(m, tmp_path / "base"), tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS, attention_mask=MASK).logits, original)
        merged = hf_model(m, seed=3)
        merged.load_state_dict(fh.classifier_to_hf(merge_lora_weights(ours, lora["alpha"] / rank), m), strict=False)
        torch.testing.assert_close(
            merged(IDS, attention_mask=MASK).logits, wrapped.merge_and_unload()(IDS, attention_mask=MASK).logits
        )
        assert not torch.allclose(
            original, base_model(m, tmp_path / "base")(IDS, attention_mask=MASK).logits, atol=1e-3
        )


def test_our_lora_exports_as_query_key_value_loras_with_our_lora_a(tmp_path):
    """Our fused LoRA of rank r -> PEFT's query/key/value LoRAs of rank r with lora_A the same and lora_B's rows split
    per head as the fused weight's; proj -> attention.output.dense; back -> the same tensors."""
    m = settings("classification", ["a", "b"])
    torch.manual_seed(0)
    ours = {}
    for i in range(LAYERS):
        ours[f"layers.{i}.self_attention.layernorm_qkv.lora_A.weight"] = torch.randn(4, H)
        ours[f"layers.{i}.self_attention.layernorm_qkv.lora_B.weight"] = torch.randn(3 * H, 4)
        ours[f"layers.{i}.self_attention.proj.lora_A.weight"] = torch.randn(4, H)
        ours[f"layers.{i}.self_attention.proj.lora_B.weight"] = torch.randn(H, 4)
    head = {
        f"head.{p}.{k}": torch.randn(s)
        for p, k, s in [
            ("dense", "weight", (H, H)),
            ("dense", "bias", (H,)),
            ("out_proj", "weight", (2, H)),
            ("out_proj", "bias", (2,)),
        ]
    }
    peft = fh.adapter_to_peft(ours | head, m)
    p = fh.PEFT_PREFIX + "esm.encoder.layer.1.attention."
    b = ours["layers.1.self_attention.layernorm_qkv.lora_B.weight"].reshape(HEADS, 3, H // HEADS, 4)
    assert torch.equal(peft[p + "self.key.lora_B.weight"], b[:, 1].reshape(H, 4))
    assert torch.equal(
        peft[p + "self.value.lora_A.weight"], ours["layers.1.self_attention.layernorm_qkv.lora_A.weight"]
    )
    assert torch.equal(peft[p + "output.dense.lora_B.weight"], ours["layers.1.self_attention.proj.lora_B.weight"])
    back, rank = fh.adapter_from_peft(peft, 4, m, tmp_path)
    assert rank == 4
    for name, value in ours.items():
        assert torch.equal(back[name], value), name
    with pytest.raises(
        ValueError,
        match="layers.0.layernorm_mlp.lora_A.weight: a PEFT adapter holds LoRA on layernorm_qkv and proj only",
    ):
        fh.adapter_to_peft(ours | head | {"layers.0.layernorm_mlp.lora_A.weight": torch.zeros(4, H)}, m)


def adapter_folder(tmp_path: Path) -> tuple[Path, Path]:
    m = settings("classification", ["a", "b", "c"])
    peft_model(m, tmp_path / "base", ["query", "value"]).save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", tmp_path / "base"


@pytest.mark.parametrize(
    "change, named",
    [
        ({"config": {"peft_type": "IA3"}}, "peft_type='IA3', expected 'LORA'"),
        ({"config": {"use_dora": True}}, "use_dora=True"),
        ({"config": {"rank_pattern": {"query": 8}}}, "rank_pattern="),
        ({"config": {"r": 2}}, r"layer 0 query lora_A is \(4, 16\), r=2"),
        (
            {
                "extra": "base_model.model.esm.encoder.layer.0.intermediate.dense.lora_A.weight",
                "config": {"target_modules": ["query", "value", "intermediate.dense"]},
            },
            "intermediate.dense.lora_A.weight: LoRA on a module this recipe cannot map",
        ),
        ({"drop": "base_model.model.classifier."}, "no classifier tensors"),
        ({"pickle": True}, r"adapter_model.bin is a pickle, which is never loaded"),
        ({"drop": "base_model.model.esm.encoder.layer.1."}, r"LoRA on other modules in different layers"),
        (
            {"config": {"target_modules": ["query"]}},
            r"'base_model.model.esm.encoder.layer.0.attention.self.value.lora_A.weight': LoRA on a module outside "
            r"target_modules=\['query'\]",
        ),
        (
            {"int8": "base_model.model.classifier.dense.weight"},
            r"adapter_model.safetensors: 'base_model.model.classifier.dense.weight' is torch.int8, not floating point",
        ),
    ],
)
def test_adapters_we_cannot_map_are_refused_by_name(tmp_path, change, named):
    adapter, base = adapter_folder(tmp_path)
    config = json.loads((adapter / fh.ADAPTER_CONFIG).read_text())
    (adapter / fh.ADAPTER_CONFIG).write_text(json.dumps(config | change.get("config", {})))
    tensors = load_file(str(adapter / fh.ADAPTER_WEIGHTS))
    if "extra" in change:
        tensors[change["extra"]] = torch.zeros(4, H)
    if "drop" in change:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(change["drop"])}
    if "int8" in change:
        tensors[change["int8"]] = tensors[change["int8"]].to(torch.int8)
    save_file(tensors, str(adapter / fh.ADAPTER_WEIGHTS))
    if change.get("pickle"):
        (adapter / fh.ADAPTER_WEIGHTS).rename(adapter / "adapter_model.bin")
    with pytest.raises((ValueError, FileNotFoundError), match=named):
        fh.import_adapter_from_hf(str(adapter), str(base), str(tmp_path / "w.safetensors"))
    assert not (tmp_path / "w.safetensors").exists()


@pytest.fixture
def registered(monkeypatch):
    """The registry's conversions with this recipe's (its recipe.py may not be in this tree yet)."""
    import recipes.registry
    from recipes.gpt import hf as gpt_hf

    conversions = {"esm2": esm_hf, "esm2_finetune": fh, "gpt": gpt_hf}
    monkeypatch.setattr(recipes.registry, "hf_conversions", lambda: conversions)


def test_from_hf_picks_the_recipe_by_architecture_and_reads_adapters_with_base(tmp_path, registered, capsys):
    """model_type esm: EsmForSequenceClassification -> esm2_finetune, EsmForMaskedLM (or no or another
    architecture) -> esm2; an adapter folder needs --base."""
    import checkpoint

    m = settings("classification", ["a", "b", "c"])
    save_folder(hf_model(m), m, tmp_path / "cls")
    assert checkpoint.importer(str(tmp_path / "cls"), str(tmp_path / "x")) is fh
    peft_model(m, tmp_path / "base", ["query", "value"]).save_pretrained(tmp_path / "adapter")
    assert checkpoint.importer(str(tmp_path / "base"), str(tmp_path / "x")) is esm_hf
    config = json.loads((tmp_path / "cls" / "config.json").read_text())
    # esm2 names no architectures: it reads every other esm folder (and names what it lacks: the LM head)
    for architectures in (None, ["EsmForQuestionAnswering"], 5, [{"a": 1}], [["EsmForSequenceClassification"]]):
        (tmp_path / "cls" / "config.json").write_text(json.dumps(config | {"architectures": architectures}))
        assert checkpoint.importer(str(tmp_path / "cls"), str(tmp_path / "x")) is esm_hf
        with pytest.raises(ValueError, match=re.escape(f"c.json: architectures={architectures!r}; from-hf reads")):
            fh.task_of({"architectures": architectures}, Path("c.json"))
    twice = {"architectures": [fh.SEQUENCE_CLASS], "id2label": {"0": "a", "00": "b", "1": "c"}}
    with pytest.raises(ValueError, match=r"c.json: id2label names a class index twice \('0', '00', '1'\)"):
        fh.task_of(twice, Path("c.json"))
    with pytest.raises(SystemExit, match="missing: lm_head.bias"):
        checkpoint.main(["from-hf", str(tmp_path / "cls"), str(tmp_path / "w.safetensors")])
    with pytest.raises(SystemExit, match="a PEFT adapter .*: name the model it adapts with --base"):
        checkpoint.main(["from-hf", str(tmp_path / "adapter"), str(tmp_path / "w.safetensors")])
    checkpoint.main(
        ["from-hf", str(tmp_path / "adapter"), str(tmp_path / "w.safetensors"), "--base", str(tmp_path / "base")]
    )
    assert "finetune.lora.rank=8" in capsys.readouterr().out
    assert "layers.1.self_attention.layernorm_qkv.lora_B.weight" in load_file(str(tmp_path / "w.safetensors"))


# --- checkpoint.init_from=<a Hugging Face folder> ------------------------------------------------------------------
def test_init_from_a_classification_folder_reads_its_head_in_the_runs_standardisation(tmp_path):
    """A regression folder (predictions in the targets' units) read for a run whose targets are standardised by
    mean/std: our head's output * std + mean = the folder's logits; the backbone as from-hf reads it."""
    m = settings("regression", ["x", "y"], "mean")
    save_folder(hf_model(m), m, tmp_path / "hf")
    run = settings("regression", ["x", "y"], "mean", target_mean=[3.0, -1.0], target_std=[2.0, 0.5])
    weights = fh.weights_from_hf_folder(tmp_path / "hf", run)
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    pooled = torch.randn(5, H)
    w, b = weights["head.out_proj.weight"], weights["head.out_proj.bias"]  # rows padded to 64: the first 2 are read
    ours = (pooled @ w[:2].T + b[:2]) * torch.tensor([2.0, 0.5])
    torch.testing.assert_close(
        ours + torch.tensor([3.0, -1.0]), pooled @ hf["classifier.out_proj.weight"].T + hf["classifier.out_proj.bias"]
    )
    plain = fh.classifier_from_hf(hf, m, fh.MEAN_POOLED_CLASS)
    assert weights.keys() == plain.keys()
    assert all(torch.equal(weights[k], plain[k]) for k in plain if not k.startswith("head.out_proj."))


def test_init_from_a_masked_lm_folder_gives_the_backbone_and_its_lm_head_as_unexpected(tmp_path):
    from transformers import EsmConfig, EsmForMaskedLM

    m = settings("classification", ["a", "b"])
    EsmForMaskedLM(EsmConfig(**esm_hf.hf_config(m))).save_pretrained(tmp_path / "lm")
    weights = fh.weights_from_hf_folder(tmp_path / "lm", m)
    assert "layers.1.self_attention.layernorm_qkv.weight" in weights and "lm_head.dense.weight" in weights
    assert not any(k.startswith("head.") for k in weights)  # the task head keeps its fresh init


@pytest.mark.parametrize(
    "run, named",
    [
        (dict(task="multilabel"), "model.task='multilabel' (config.json: 'classification')"),
        (dict(classes=["a", "c", "b"]), "model.classes=['a', 'c', 'b'] (config.json: ['a', 'b', 'c'])"),
        (dict(classes=["a", "b"]), "model.classes=['a', 'b']"),
        (dict(pooling="mean"), "model.pooling='mean' (config.json: 'cls')"),
        (dict(ffn_hidden_size=64), "model.ffn_hidden_size=64 (config.json: 32)"),
    ],
)
def test_init_from_a_classification_folder_of_another_head_is_refused_by_name(tmp_path, run, named):
    m = settings("classification", ["a", "b", "c"])
    save_folder(hf_model(m), m, tmp_path / "hf")
    with pytest.raises(ValueError, match=re.escape(named)):
        fh.weights_from_hf_folder(tmp_path / "hf", SimpleNamespace(**(vars(m) | run)))


def test_init_from_a_folder_with_transformers_default_label_names_takes_the_runs_names(tmp_path):
    m = settings("classification", ["LABEL_0", "LABEL_1", "LABEL_2"])
    save_folder(hf_model(m), m, tmp_path / "hf")
    weights = fh.weights_from_hf_folder(tmp_path / "hf", settings("classification", ["a", "b", "c"]))
    assert weights["head.out_proj.weight"].shape == (64, H)  # 3 classes, rows padded to 64
