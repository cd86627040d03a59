"""Fine-tuned ESM-2 models to and from Hugging Face: EsmForSequenceClassification / EsmForTokenClassification
folders (LoRA merged) and PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors).

    ours                                              Hugging Face
    the backbone (ESM-2's names, no lm_head)          esm.* (as recipes/esm2/hf.py maps EsmForMaskedLM's)
    head.dense.*, head.out_proj.* (sequence tasks)    classifier.dense.*, classifier.out_proj.*
    head.out_proj.* (residue_classification)          classifier.*  (EsmForTokenClassification)
    model.task, model.classes                         problem_type, num_labels, id2label / label2id
    model.target_mean / target_std (regression)       folded into classifier.out_proj: HF logits = our predictions
    model.pooling=mean                                Esm2MeanPooledForSequenceClassification (hf_mean_pooling.py,
                                                      copied into the folder; trust_remote_code=True)
    LoRA on layernorm_qkv (fused rows: per head       PEFT LoRA on attention.self.query / key / value (lora_A the
      [q, k, v]) and on proj                          same, lora_B's rows split as the weight's), attention.output.dense

Writing needs json and safetensors only; reading runs no code from the folder (no .bin is unpickled).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from core.checkpointing.hf_folders import (  # noqa: F401 (ADAPTER_*, PEFT_PREFIX: this recipe's names too)
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    check_adapter_config,
    check_adapter_targets,
    lora_settings,
    our_lora_alpha,
    override,
    peft_lora_config,
    read_adapter,
    read_json_object,
)
from recipes.esm2 import hf as esm_hf
from recipes.esm2_finetune.model import out_rows

RECIPE = "esm2_finetune"
MEAN_POOLED_MODEL_TYPE = "esm2_mean_pooled"  # = hf_mean_pooling.MODEL_TYPE (that file imports transformers)
MEAN_POOLED_CLASS = "Esm2MeanPooledForSequenceClassification"
MODELING_FILE = "hf_mean_pooling.py"
SEQUENCE_CLASS, TOKEN_CLASS = "EsmForSequenceClassification", "EsmForTokenClassification"
# What checkpoint.py from-hf reads: config.json model_type values, and the architectures that make a folder of the
# esm model_type this recipe's (an EsmForMaskedLM is the esm2 recipe's).
HF_MODEL_TYPES = ("esm", MEAN_POOLED_MODEL_TYPE)
HF_ARCHITECTURES = (SEQUENCE_CLASS, TOKEN_CLASS, MEAN_POOLED_CLASS)
PROBLEM_TYPES = {
    "regression": "regression",
    "classification": "single_label_classification",
    "multilabel": "multi_label_classification",
}
RESIDUE = "residue_classification"

# Our LoRA modules -> the PEFT modules they become, per layer (a full-name regex keeps PEFT off the other `dense`).
PEFT_TARGETS = r"esm\.encoder\.layer\.\d+\.attention\.(self\.(query|key|value)|output\.dense)"
QKV_PARTS = ("query", "key", "value")


def num_labels(m: Any) -> int:
    if not m.classes:
        raise ValueError("the run's config has no model.classes (the class or target names); nothing was written")
    return len(m.classes)


def head_shapes(task: str, k: int, h: int) -> dict[str, tuple[int, ...]]:
    """The HF head's tensors for `task` with `k` labels on hidden size `h`."""
    if task == RESIDUE:
        return {"classifier.weight": (k, h), "classifier.bias": (k,)}
    return {
        "classifier.dense.weight": (h, h),
        "classifier.dense.bias": (h,),
        "classifier.out_proj.weight": (k, h),
        "classifier.out_proj.bias": (k,),
    }


def _head_names(task: str) -> dict[str, str]:
    """Our head's names -> HF's."""
    if task == RESIDUE:
        return {"head.out_proj.weight": "classifier.weight", "head.out_proj.bias": "classifier.bias"}
    return {f"head.{p}.{kind}": f"classifier.{p}.{kind}" for p in ("dense", "out_proj") for kind in ("weight", "bias")}


def head_to_hf(weights: dict[str, torch.Tensor], m: Any) -> dict[str, torch.Tensor]:
    """Our head -> HF's classifier, regression's standardisation folded into the output layer
    (prediction = out * std + mean: W' = std W, b' = std b + mean)."""
    names, k = _head_names(m.task), num_labels(m)
    missing = [n for n in names if n not in weights]
    if missing:
        raise ValueError(f"the weights hold no {missing[0]}: not a {m.task} model of this config; nothing was written")
    # out_proj holds its k rows padded (recipes/esm2_finetune/model.py:out_rows): HF's has k
    out = {
        theirs: weights[ours].float()[:k] if ".out_proj." in ours else weights[ours].float()
        for ours, theirs in names.items()
    }
    if m.task == "regression":
        w, b = ("classifier.out_proj." + kind for kind in ("weight", "bias"))
        std, mean = _standardisation(m, k)
        out[w], out[b] = out[w] * std[:, None], out[b] * std + mean
    return out


def _standardisation(m: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    std = m.target_std if m.target_std is not None else [1.0] * k
    mean = m.target_mean if m.target_mean is not None else [0.0] * k
    if len(std) != k or len(mean) != k:
        raise ValueError(f"model.target_mean/target_std: {len(mean)}/{len(std)} values for {k} regression targets")
    return torch.tensor(std, dtype=torch.float32), torch.tensor(mean, dtype=torch.float32)


def head_from_hf(hf: dict[str, torch.Tensor], task: str) -> dict[str, torch.Tensor]:
    """HF's classifier -> our head (regression: as target_mean 0, target_std 1, which the import prints), out_proj's
    rows padded with zeros to the rows our head holds (recipes/esm2_finetune/model.py:out_rows)."""
    head = {ours: hf[theirs].float() for ours, theirs in _head_names(task).items()}
    for ours, t in head.items():
        if ".out_proj." in ours:
            head[ours] = torch.cat([t, t.new_zeros(out_rows(t.shape[0]) - t.shape[0], *t.shape[1:])])
    return head


def classifier_to_hf(weights: dict[str, torch.Tensor], m: Any) -> dict[str, torch.Tensor]:
    """Our fine-tuned model's state dict (LoRA merged already) -> EsmFor*Classification's."""
    lora = [k for k in weights if ".lora_A." in k or ".lora_B." in k]
    if lora:
        raise ValueError(f"{lora[0]}: merge the LoRA weights first (merge_lora_weights)")
    if m.task not in (*PROBLEM_TYPES, RESIDUE):
        raise ValueError(f"model.task={m.task!r}: not one of {', '.join((*PROBLEM_TYPES, RESIDUE))}")
    return esm_hf.to_hf(weights, m, lm_head=False) | {k: v.contiguous() for k, v in head_to_hf(weights, m).items()}


def classifier_from_hf(hf: dict[str, torch.Tensor], m: Any, model_class: str) -> dict[str, torch.Tensor]:
    """EsmFor*Classification's state dict -> ours (checked first: the backbone and the head of `m.task` with
    len(m.classes) labels, nothing left over)."""
    hf = esm_hf.canonical_hf_names(hf)
    shapes = head_shapes(m.task, len(m.classes), m.hidden_size)
    backbone = esm_hf.from_hf(hf, m, shapes, model_class=model_class)
    return backbone | head_from_hf(hf, m.task)


def hf_config(m: Any, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the EsmFor*Classification (or, for model.pooling=mean, the mean-pooled model) our `m` equals."""
    config = esm_hf.hf_config(m, dtype)
    labels = dict(enumerate(m.classes))
    config |= {"num_labels": len(labels), "id2label": labels, "label2id": {v: i for i, v in labels.items()}}
    if len(set(m.classes)) != len(m.classes):
        raise ValueError(f"model.classes={m.classes!r} names a class twice; nothing was written")
    if m.task == RESIDUE:
        return config | {"architectures": [TOKEN_CLASS], "problem_type": "single_label_classification"}
    config |= {"architectures": [SEQUENCE_CLASS], "problem_type": PROBLEM_TYPES[m.task]}
    if m.pooling == "mean":
        module = Path(MODELING_FILE).stem
        config |= {
            "architectures": [MEAN_POOLED_CLASS],
            "model_type": MEAN_POOLED_MODEL_TYPE,
            "pooling": "mean",
            "auto_map": {
                "AutoConfig": f"{module}.Esm2MeanPooledConfig",
                "AutoModelForSequenceClassification": f"{module}.{MEAN_POOLED_CLASS}",
            },
        }
    return config


def write_modeling_file(out: Path) -> str:
    shutil.copyfile(Path(__file__).with_name(MODELING_FILE), out / MODELING_FILE)
    return MODELING_FILE


# --- PEFT adapters ---------------------------------------------------------------------------------------------
def split_qkv_rows(t: torch.Tensor, m: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of our fused QKV layout (per head [q, k, v]; fuse_qkv_params=false: q, k, v concatenated) -> q, k, v."""
    if not m.fuse_qkv_params:
        return t.chunk(3)
    heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads
    per_head = t.reshape(heads, 3, head_dim, *t.shape[1:])
    return tuple(per_head[:, j].reshape(heads * head_dim, *t.shape[1:]) for j in range(3))


def join_qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: Any) -> torch.Tensor:
    """split_qkv_rows' inverse."""
    if not m.fuse_qkv_params:
        return torch.cat([q, k, v])
    heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads
    stacked = torch.stack([t.reshape(heads, head_dim, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return stacked.reshape(3 * heads * head_dim, *q.shape[1:])


def _our_lora_module(name: str) -> Optional[tuple[int, str]]:
    """(layer, 'layernorm_qkv' | 'proj') of one of our LoRA parameter names, None for any other module's."""
    found = re.fullmatch(r"layers\.(\d+)\.self_attention\.(layernorm_qkv|proj)\.lora_[AB]\.weight", name)
    return (int(found[1]), found[2]) if found else None


def adapter_to_peft(weights: dict[str, torch.Tensor], m: Any) -> dict[str, torch.Tensor]:
    """Our LoRA matrices and head -> the tensors of a PEFT adapter_model.safetensors (its key names)."""
    lora = {k: v for k, v in weights.items() if ".lora_A." in k or ".lora_B." in k}
    if not lora:
        raise ValueError("the run has no LoRA weights (finetune.mode is not lora): export the model without --adapter")
    odd = [k for k in lora if _our_lora_module(k) is None]
    if odd:
        raise ValueError(f"{odd[0]}: a PEFT adapter holds LoRA on layernorm_qkv and proj only; nothing was written")
    out = {}
    for name, t in lora.items():
        layer, module = _our_lora_module(name)
        side = "lora_A" if ".lora_A." in name else "lora_B"
        theirs = f"esm.encoder.layer.{layer}.attention."
        if module == "proj":
            out[f"{theirs}output.dense.{side}.weight"] = t
            continue
        parts = (t.clone(), t.clone(), t.clone()) if side == "lora_A" else split_qkv_rows(t, m)  # 3 tensors on disk
        for part, piece in zip(QKV_PARTS, parts):
            out[f"{theirs}self.{part}.{side}.weight"] = piece
    out |= head_to_hf(weights, m)
    return {PEFT_PREFIX + k: v.float().contiguous() for k, v in out.items()}


def adapter_config(m: Any, lora: dict[str, Any]) -> dict[str, Any]:
    """adapter_config.json of adapter_to_peft's tensors (finetune.lora's rank, alpha and dropout)."""
    task_type = "TOKEN_CLS" if m.task == RESIDUE else "SEQ_CLS"
    return peft_lora_config(lora, task_type, PEFT_TARGETS, modules_to_save=["classifier"])


def _peft_module(name: str) -> Optional[tuple[int, str, str]]:
    """(layer, 'query' | 'key' | 'value' | 'proj', 'lora_A' | 'lora_B') of a PEFT LoRA tensor name we map."""
    found = re.fullmatch(
        r"esm\.encoder\.layer\.(\d+)\.attention\.(?:self\.(query|key|value)|(output\.dense))\.(lora_[AB])\.weight", name
    )
    return (int(found[1]), found[2] or "proj", found[4]) if found else None


def adapter_from_peft(tensors: dict[str, torch.Tensor], r: int, m: Any, file: Path) -> tuple[dict, int]:
    """A PEFT adapter's tensors -> our LoRA matrices (+ the head's HF tensors, by HF name) and the rank of our
    LoRA. Query/key/value LoRAs become one LoRA of the fused QKV: lora_A the same when theirs are equal, else
    theirs stacked (rank = r per part) with lora_B block-structured, which computes the same update exactly; proj
    is padded with zero rows/columns to that rank (LoRA has one rank for every module)."""
    if any(not k.startswith(PEFT_PREFIX) for k in tensors):
        odd = next(k for k in tensors if not k.startswith(PEFT_PREFIX))
        raise ValueError(f"{file}: {odd} is not a PEFT adapter tensor ({PEFT_PREFIX}...); nothing was imported")
    tensors = {k.removeprefix(PEFT_PREFIX): v.float() for k, v in tensors.items()}
    head = {k: v for k, v in tensors.items() if k.startswith("classifier.")}
    lora, per_layer = {}, {}
    for name, t in tensors.items():
        if name in head:
            continue
        parsed = _peft_module(name)
        if parsed is None:
            raise ValueError(
                f"{file}: {name}: LoRA on a module this recipe cannot map (it maps attention's query, "
                "key, value and output.dense); nothing was imported"
            )
        layer, module, side = parsed
        if layer >= m.num_layers:
            raise ValueError(f"{file}: {name}: the base model has {m.num_layers} layers; nothing was imported")
        lora[(layer, module, side)] = t
        per_layer.setdefault(layer, set()).add(module)
    kinds = {frozenset(modules) for modules in per_layer.values()}
    if len(kinds) != 1 or len(per_layer) != m.num_layers:
        raise ValueError(
            f"{file}: LoRA on other modules in different layers ({sorted(per_layer)} of {m.num_layers} "
            "layers): finetune.lora.target_modules applies to every layer; nothing was imported"
        )
    parts = [p for p in QKV_PARTS if p in next(iter(kinds))]
    _check_lora_shapes(lora, r, m.hidden_size, file)
    same_a = len(parts) == 3 and all(
        torch.equal(lora[(i, "query", "lora_A")], lora[(i, p, "lora_A")]) for i in per_layer for p in parts
    )
    rank = r if same_a or not parts else r * len(parts)
    return _fused_lora(lora, parts, "proj" in next(iter(kinds)), same_a, rank, m) | head, rank


def _check_lora_shapes(lora: dict, r: int, h: int, file: Path) -> None:
    for (layer, module, side), t in sorted(lora.items()):
        want = (r, h) if side == "lora_A" else (h, r)
        if tuple(t.shape) != want:
            raise ValueError(
                f"{file}: layer {layer} {module} {side} is {tuple(t.shape)}, r={r} and hidden size "
                f"{h} make it {want}; nothing was imported"
            )
    halves = {(layer, module) for layer, module, _ in lora}
    for layer, module in sorted(halves):
        if {(layer, module, "lora_A"), (layer, module, "lora_B")} - set(lora):
            raise ValueError(
                f"{file}: layer {layer} {module}: lora_A without lora_B or the reverse; nothing was imported"
            )


def _fused_lora(lora: dict, parts: list, proj: bool, same_a: bool, rank: int, m: Any) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(m.num_layers):
        ours = f"layers.{i}.self_attention."
        if parts:
            if same_a:
                a, blocks = lora[(i, "query", "lora_A")], {p: lora[(i, p, "lora_B")] for p in parts}
            else:
                a = torch.cat([lora[(i, p, "lora_A")] for p in parts])
                r = a.shape[0] // len(parts)
                blocks = {}
                for j, p in enumerate(parts):  # B_p in its own column block: rows of p see only A_p
                    blocks[p] = torch.zeros(m.hidden_size, rank)
                    blocks[p][:, j * r : (j + 1) * r] = lora[(i, p, "lora_B")]
            zero = torch.zeros(m.hidden_size, rank)
            out[ours + "layernorm_qkv.lora_A.weight"] = a
            out[ours + "layernorm_qkv.lora_B.weight"] = join_qkv_rows(*(blocks.get(p, zero) for p in QKV_PARTS), m)
        if proj:
            a, b = lora[(i, "proj", "lora_A")], lora[(i, "proj", "lora_B")]
            padding = rank - a.shape[0]  # zero rows of A and columns of B: no update, none learnt either
            out[ours + "proj.lora_A.weight"] = torch.cat([a, a.new_zeros(padding, a.shape[1])])
            out[ours + "proj.lora_B.weight"] = torch.cat([b, b.new_zeros(b.shape[0], padding)], dim=1)
    return {k: v.contiguous() for k, v in out.items()}


# --- the commands: checkpoint.py to-hf [--adapter] / from-hf [--base] -----------------------------------------------
def _read_fine_tuned(source: str, config: Optional[str], verify_checksums: bool) -> tuple[Any, dict, Optional[dict]]:
    """(model settings, fp32 weights, finetune.lora settings or None without LoRA) of a run of this recipe."""
    from core.checkpointing.hf_folders import read_run
    from recipes.registry import get_recipe

    saved, weights = read_run(Path(source), config, verify_checksums, RECIPE, get_recipe)
    m = SimpleNamespace(**saved.section("model"))
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}  # LoRA's frozen base: bf16
    ranks = {v.shape[0] for k, v in weights.items() if k.endswith(".lora_A.weight")}
    if not ranks:
        return m, weights, None
    lora = lora_settings(saved.file)
    if ranks != {lora["rank"]}:
        raise ValueError(
            f"{saved.file}: finetune.lora.rank={lora['rank']}, the weights' LoRA ranks are {sorted(ranks)}"
        )
    return m, weights, lora


def _new_folder(out_dir: str) -> Path:
    from core.checkpointing.layout import CheckpointError

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new folder")
    return out


def export_to_hf(
    source: str,
    out_dir: str,
    verify_checksums: bool = True,
    dtype: str = "float32",
    config: Optional[str] = None,
    adapter: bool = False,
) -> dict:
    """checkpoint.py to-hf for an esm2_finetune run: a step folder (or weights file + its run's config) -> an
    EsmFor*Classification folder with LoRA merged (transformers loads it; model.pooling=mean: with
    trust_remote_code=True), or with `adapter` a PEFT LoRA adapter. Returns the written config.json."""
    from core.checkpointing.layout import CheckpointError
    from core.checkpointing.output_files import save_safetensors
    from core.layers.lora import merge_lora_weights

    out = _new_folder(out_dir)
    m, weights, lora = _read_fine_tuned(source, config, verify_checksums)
    if adapter:
        if lora is None:
            raise CheckpointError(f"{source}: no LoRA weights (finetune.mode is not lora): leave out --adapter")
        return export_adapter(weights, m, lora, out)
    if lora is not None:
        weights = merge_lora_weights(weights, lora["alpha"] / lora["rank"])
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = {k: v.to(torch_dtype) for k, v in classifier_to_hf(weights, m).items()}
    written = hf_config(m, dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(hf, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    files = esm_hf.write_tokenizer(out, m.max_seq_length)
    if written["model_type"] == MEAN_POOLED_MODEL_TYPE:
        files.append(write_modeling_file(out))
    note = "" if m.activation == "gelu_erf" else "; trained with TE's GELU (tanh form): HF's logits differ a little"
    remote = ", load it with trust_remote_code=True (mean pooling)" if MODELING_FILE in files else ""
    print(
        f"wrote {out}: {written['architectures'][0]} ({m.task}, {len(m.classes)} labels{', LoRA merged' * bool(lora)}"
        f"), {sum(v.numel() for v in hf.values()):,} parameters ({dtype}); {', '.join(files)}{remote}{note}"
    )
    return written


def export_adapter(weights: dict[str, torch.Tensor], m: Any, lora: dict, out: Path) -> dict:
    """to-hf --adapter: adapter_config.json + adapter_model.safetensors (+ the mean-pooling model's file)."""
    from core.checkpointing.output_files import save_safetensors

    tensors = adapter_to_peft(weights, m)
    written = adapter_config(m, lora)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"task": m.task, "classes": list(m.classes), "pooling": getattr(m, "pooling", "cls")}
    save_safetensors(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt", RECIPE: json.dumps(settings)})
    (out / ADAPTER_CONFIG).write_text(json.dumps(written, indent=2) + "\n")
    base = TOKEN_CLASS if m.task == RESIDUE else SEQUENCE_CLASS
    if m.task != RESIDUE and m.pooling == "mean":
        write_modeling_file(out)
        base = f"{MEAN_POOLED_CLASS} (in {MODELING_FILE}: mean pooling)"
    print(
        f"wrote {out}: a PEFT LoRA adapter (r={lora['rank']}, alpha={lora['alpha']:g}, {len(tensors)} tensors) "
        f"for {base} built from the run's Hugging Face ESM-2 folder with num_labels={len(m.classes)}: "
        "PeftModel.from_pretrained(base, folder)"
    )
    return written


def first_architecture(config: dict[str, Any]) -> Optional[str]:
    """config.json's first architecture where it lists them as save_pretrained writes them (strings); else None."""
    listed = config.get("architectures")
    return listed[0] if isinstance(listed, list) and listed and isinstance(listed[0], str) else None


def task_of(config: dict[str, Any], file: Path) -> tuple[str, list[str], str]:
    """(model.task, model.classes, model.pooling) of an EsmFor*Classification config.json."""
    architecture = first_architecture(config)
    if architecture not in HF_ARCHITECTURES:
        raise ValueError(
            f"{file}: architectures={config.get('architectures')!r}; from-hf reads {', '.join(HF_ARCHITECTURES)}"
        )
    if (architecture == MEAN_POOLED_CLASS) != (config.get("model_type") == MEAN_POOLED_MODEL_TYPE):
        raise ValueError(f"{file}: architectures {architecture} with model_type {config.get('model_type')!r}")
    labels, count = config.get("id2label"), config.get("num_labels")
    if isinstance(labels, dict) and labels:
        try:
            indexed = {int(k): v for k, v in labels.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{file}: id2label keys {sorted(labels)[:3]} are not class indices") from None
        if len(indexed) != len(labels):  # "0" and "00": which name is class 0's?
            raise ValueError(f"{file}: id2label names a class index twice ({', '.join(map(repr, sorted(labels)))})")
        if sorted(indexed) != list(range(len(indexed))) or not all(isinstance(v, str) and v for v in indexed.values()):
            raise ValueError(f"{file}: id2label is not 0..{len(indexed) - 1} -> class names")
        classes = [indexed[i] for i in range(len(indexed))]
    elif isinstance(count, int) and not isinstance(count, bool) and 0 < count < 1 << 20:
        classes = [f"LABEL_{i}" for i in range(count)]
    else:
        raise ValueError(f"{file}: neither id2label nor num_labels says how many labels the classifier has")
    if len(set(classes)) != len(classes):
        raise ValueError(f"{file}: id2label names a class twice")
    if architecture == TOKEN_CLASS:
        return RESIDUE, classes, "mean"
    problem = config.get("problem_type") or ("regression" if len(classes) == 1 else "single_label_classification")
    tasks = {v: k for k, v in PROBLEM_TYPES.items()}
    if problem not in tasks:
        raise ValueError(f"{file}: problem_type={problem!r}, expected one of {', '.join(tasks)}")
    return tasks[problem], classes, "mean" if architecture == MEAN_POOLED_CLASS else "cls"


def list_override(key: str, values: list) -> str:
    """`key=[...]` as one shell word that Hydra reads back as `values` (texts quoted, numbers as they are)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    items = [json.dumps(v) if isinstance(v, str) else repr(float(v)) for v in values]
    text = f"{key}=[{','.join(items)}]"
    if OverridesParser.create().parse_override(text).value() != values:
        raise ValueError(f"{key}: {values!r} cannot be written as a command-line override; set it in a config file")
    return shlex.quote(text)


def _print_settings(target: Path, m: Any, task: str, classes: list, pooling: str, extra: list[str]) -> list[str]:
    settings = esm_hf.settings_overrides(m) + [f"model.task={task}", list_override("model.classes", classes)]
    if task != RESIDUE:
        settings.append(f"model.pooling={pooling}")
    if task == "regression":  # the standardisation is folded into the weights: none on top
        settings += [list_override("model.target_mean", [0.0] * len(classes))]
        settings += [list_override("model.target_std", [1.0] * len(classes))]
    settings += extra
    print(f"fine-tune or predict with: recipe={RECIPE} {override('checkpoint.init_from', target)} {' '.join(settings)}")
    return settings


def _say_written(weights: dict[str, torch.Tensor], target: Path) -> None:
    """The line a weights file gets (a step folder's writer prints its own: core/checkpointing/conversion.py)."""
    if target.suffix in (".safetensors", ".pt", ".pth"):
        print(f"wrote {len(weights)} tensors to {target}")


def import_from_hf(hf_dir: str, out: str, fuse_qkv: bool = True) -> list[str]:
    """checkpoint.py from-hf for an EsmForSequenceClassification / EsmForTokenClassification folder (or the
    mean-pooled model's to-hf writes) -> esm2_finetune weights (checkpoint.init_from); prints and returns the
    settings to train or predict with."""
    from core.checkpointing.hf_folders import read_hf_folder, write_weights

    folder, target, config, hf = read_hf_folder(hf_dir, out)
    file = folder / "config.json"
    if (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{folder}: a PEFT adapter folder: give the model it adapts with --base <HF folder>")
    task, classes, pooling = task_of(config, file)
    m = esm_hf.check_esm2_config(config | {"model_type": "esm"}, file, fuse_qkv)
    m.task, m.classes = task, classes
    weights = classifier_from_hf(hf, m, config["architectures"][0])
    write_weights(weights, target, str(folder))
    _say_written(weights, target)
    return _print_settings(target, m, task, classes, pooling, [])


def import_adapter_from_hf(adapter_dir: str, base_dir: str, out: str, fuse_qkv: bool = True) -> list[str]:
    """checkpoint.py from-hf <PEFT adapter> --base <HF ESM-2 folder>: the base's backbone with the adapter's LoRA
    (unmerged: checkpoint.init_from with finetune.mode=lora trains on) and classifier -> esm2_finetune weights;
    prints and returns the settings (finetune.lora's too)."""
    from core.checkpointing.hf_folders import read_hf_folder, write_weights

    folder = Path(adapter_dir)
    config, tensors, ours = read_adapter(folder, RECIPE)
    r, alpha = check_adapter_config(config, folder / ADAPTER_CONFIG)
    check_adapter_targets(config, tensors, folder)
    base, target, base_config, hf = read_hf_folder(base_dir, out)
    m = esm_hf.check_esm2_config(base_config | {"model_type": "esm"}, base / "config.json", fuse_qkv)
    backbone = {k: v for k, v in hf.items() if not k.startswith(("lm_head.", "classifier."))}  # the base's own heads
    weights = esm_hf.from_hf(backbone, m, {}, model_class="backbone")
    lora, rank = adapter_from_peft(tensors, r, m, folder / ADAPTER_WEIGHTS)
    our_alpha = our_lora_alpha(r, alpha, rank, folder / ADAPTER_CONFIG)
    head = {k: lora.pop(k) for k in list(lora) if k.startswith("classifier.")}
    task, classes, pooling, why = _adapter_task(head, ours, m.hidden_size, folder / ADAPTER_WEIGHTS)
    weights |= lora | head_from_hf(head, task)
    write_weights(weights, target, str(folder))
    _say_written(weights, target)
    modules = [n for n, key in (("layernorm_qkv", "layernorm_qkv"), ("proj", "proj.")) if any(key in k for k in lora)]
    extra = [
        "finetune.mode=lora",
        f"finetune.lora.rank={rank}",
        f"finetune.lora.alpha={our_alpha:g}",
        f"finetune.lora.target_modules=[{','.join(modules)}]",
    ]
    if why:
        print(why)
    return _print_settings(target, m, task, classes, pooling, extra)


def _adapter_task(head: dict[str, torch.Tensor], ours: dict, h: int, file: Path) -> tuple[str, list, str, str]:
    """(task, classes, pooling, a note when the adapter does not say) from the adapter's classifier tensors and the
    settings our export keeps in its metadata; the classifier's tensors are checked."""
    if not head:
        raise ValueError(f"{file}: no classifier tensors (modules_to_save): the adapter holds no task head")
    residue = "classifier.weight" in head
    out_proj = head.get("classifier.weight" if residue else "classifier.out_proj.weight")
    k = out_proj.shape[0] if out_proj is not None and out_proj.dim() == 2 else 0
    task, note = (RESIDUE, "") if residue else (ours.get("task"), "")
    if task not in (*PROBLEM_TYPES, RESIDUE) or (task == RESIDUE) != residue:
        task = "classification"
        note = "the adapter does not say its task: model.task=classification; set regression or multilabel if it is"
    from core.checkpointing.hf_folders import weight_mismatches

    problems = weight_mismatches(head, head_shapes(task, k, h), lambda _: False, f"{k} labels, hidden size {h}")
    if problems or k == 0:
        raise ValueError(f"{file}: the classifier does not fit: {'; '.join(problems) or 'no output layer'}")
    classes = ours.get("classes")
    if not (isinstance(classes, list) and len(classes) == k and all(isinstance(c, str) for c in classes)):
        classes = [f"LABEL_{i}" for i in range(k)]
    pooling = ours.get("pooling") if ours.get("pooling") in ("mean", "cls") else "cls"  # PEFT's base: <cls>
    return task, classes, pooling, note


# --- checkpoint.init_from=<a Hugging Face folder> ------------------------------------------------------------------
def weights_from_hf_folder(folder: Path, model: Any) -> dict[str, torch.Tensor]:
    """checkpoint.init_from=<a Hugging Face folder> for a run of this recipe, converted in memory (nothing written):
    an EsmForMaskedLM folder gives the backbone (its LM head is unexpected here: checkpoint.init_ignore_unexpected
    leaves it out; the task head keeps its fresh init); an EsmFor*Classification folder (or the mean-pooled model's)
    gives the backbone and its head, when its task, pooling and classes are the run's. The run's model settings must
    be config.json's (ValueError naming the keys that differ)."""
    from core.checkpointing.hf_folders import read_hf_weights

    file = Path(folder) / "config.json"
    config = read_json_object(file)
    if first_architecture(config) not in HF_ARCHITECTURES:
        return esm_hf.weights_from_hf_folder(folder, model)
    task, classes, pooling = task_of(config, file)
    m = esm_hf.check_esm2_config(config | {"model_type": "esm"}, file, bool(model.fuse_qkv_params))
    _check_same_task(model, task, classes, pooling, file)
    differ = [
        f"model.{key}={getattr(model, key)!r} (config.json: {getattr(m, key)!r})"
        for key in esm_hf.SETTINGS
        if getattr(model, key) != getattr(m, key)
    ]
    if differ:
        raise ValueError(
            f"the run's model settings differ from {file}'s: {', '.join(differ)}; set them as the folder has them"
        )
    m.task, m.classes = task, classes
    hf = {k: v.float() if v.is_floating_point() else v for k, v in read_hf_weights(Path(folder)).items()}
    weights = classifier_from_hf(hf, m, config["architectures"][0])
    if task == "regression":  # the folder predicts in the targets' units; our head predicts standardised targets
        std, mean = _standardisation(model, len(classes))
        k = len(classes)
        w, b = weights["head.out_proj.weight"].clone(), weights["head.out_proj.bias"].clone()
        w[:k], b[:k] = w[:k] / std[:, None], (b[:k] - mean) / std
        weights["head.out_proj.weight"], weights["head.out_proj.bias"] = w, b
    return weights


def _check_same_task(model: Any, task: str, classes: list[str], pooling: str, file: Path) -> None:
    """ValueError naming the settings where a classification folder's head is not the run's head."""
    ours = list(model.classes or [])
    named = classes != [f"LABEL_{i}" for i in range(len(classes))]  # transformers' default names say nothing
    differ = [
        f"model.{key}={value!r} (config.json: {theirs!r})"
        for key, value, theirs, fits in (
            ("task", str(model.task), task, str(model.task) == task),
            ("classes", ours, classes, ours == classes if named else len(ours) == len(classes)),
            ("pooling", str(model.pooling), pooling, task == RESIDUE or str(model.pooling) == pooling),
        )
        if not fits
    ]
    if differ:
        raise ValueError(
            f"{file} holds another task head than the run's: {', '.join(differ)}; set them as the folder has them, "
            "or start from the backbone alone (an EsmForMaskedLM folder, or init_skip_prefixes=[head])"
        )
