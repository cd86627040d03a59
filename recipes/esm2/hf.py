"""ESM-2 weights to and from Hugging Face's EsmForMaskedLM (the layout of the facebook/esm2_* checkpoints).

Our names are TE's (recipes/esm2/model.py); the Q, K and V projections are one weight whose rows are grouped
per head as [q, k, v] (TE's interleaved layout), where Hugging Face keeps three. The LM head's decoder is the
embedding matrix in both (tied). The contact-prediction head of EsmForMaskedLM is not ours: it is left out.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from core.checkpointing.hf_folders import layer_count, override, weight_mismatches
from recipes.esm2.model import TABLE_ROWS, VOCAB_SIZE
from recipes.esm2.tokenizer import CLS, EOS, MASK, PAD, VOCABULARY

# The config.json model_type values import_from_hf reads (checkpoint.py from-hf picks the recipe by them).
HF_MODEL_TYPES = ("esm",)
HF_PREFIX = "esm."


def _renames(num_layers: int, lm_head: bool = True) -> dict[str, str]:
    """Our name -> Hugging Face's, for every tensor that maps one to one (the backbone's alone for
    lm_head=False: the fine-tuning recipe's classification models, recipes/esm2_finetune/hf.py)."""
    names = {
        "embedding.weight": "esm.embeddings.word_embeddings.weight",
        "final_norm.weight": "esm.encoder.emb_layer_norm_after.weight",
        "final_norm.bias": "esm.encoder.emb_layer_norm_after.bias",
    }
    if lm_head:
        names |= {
            "lm_head.dense.weight": "lm_head.dense.weight",
            "lm_head.dense.bias": "lm_head.dense.bias",
            "lm_head.norm.weight": "lm_head.layer_norm.weight",
            "lm_head.norm.bias": "lm_head.layer_norm.bias",
            "lm_head.bias": "lm_head.bias",
        }
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"esm.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            names[f"{ours}self_attention.layernorm_qkv.layer_norm_{kind}"] = f"{theirs}attention.LayerNorm.{kind}"
            names[f"{ours}self_attention.proj.{kind}"] = f"{theirs}attention.output.dense.{kind}"
            names[f"{ours}layernorm_mlp.layer_norm_{kind}"] = f"{theirs}LayerNorm.{kind}"
            names[f"{ours}layernorm_mlp.fc1_{kind}"] = f"{theirs}intermediate.dense.{kind}"
            names[f"{ours}layernorm_mlp.fc2_{kind}"] = f"{theirs}output.dense.{kind}"
    return names


def to_hf(weights: dict[str, torch.Tensor], m: Any, lm_head: bool = True) -> dict[str, torch.Tensor]:
    """Our model's state dict (TE's `_extra_state` entries ignored) -> EsmForMaskedLM's (lm_head=False: its `esm.`
    backbone alone); refused, naming them, when the weights do not fit the model settings `m` (another recipe's,
    another size)."""
    layers = layer_count(weights, "layers.")
    if layers != m.num_layers:
        raise ValueError(f"the config gives model.num_layers={m.num_layers}, the weights hold {layers} layers")
    qkv = ("layernorm_qkv.weight",) if m.fuse_qkv_params else ("layernorm_qkv.query_weight",)
    wanted = [
        *_renames(m.num_layers, lm_head),
        *(f"layers.{i}.self_attention.{n}" for i in range(m.num_layers) for n in qkv),
    ]
    missing = [name for name in wanted if name not in weights]
    if missing:
        raise ValueError(
            f"the weights are not an ESM-2 model of this config: {len(missing)} tensors missing, e.g. {missing[:3]}"
        )
    heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads
    out = {theirs: weights[ours] for ours, theirs in _renames(m.num_layers, lm_head).items()}
    for name in ("esm.embeddings.word_embeddings.weight", "lm_head.bias")[: 2 if lm_head else 1]:
        out[name] = out[name][:VOCAB_SIZE]  # our tables' padding rows left out
    if lm_head:
        out["lm_head.decoder.weight"] = out["esm.embeddings.word_embeddings.weight"]  # tied: HF expects both names
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.self_attention.layernorm_qkv.", f"esm.encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            if m.fuse_qkv_params:
                packed = weights[ours + kind]
                per_head = packed.reshape(heads, 3, head_dim, *packed.shape[1:])
                q, k, v = (per_head[:, j].reshape(heads * head_dim, *packed.shape[1:]) for j in range(3))
            else:
                q, k, v = (weights[f"{ours}{part}_{kind}"] for part in ("query", "key", "value"))
            out[theirs + f"query.{kind}"], out[theirs + f"key.{kind}"], out[theirs + f"value.{kind}"] = q, k, v
    # every shape (the FFN width, ...)
    check_hf_weights(out, m, "the run's model config", "nothing was written", {} if not lm_head else None)
    out["esm.rotary_embeddings.inv_freq"] = rotary_inverse_frequencies(m)
    return {k: v.contiguous() for k, v in out.items()}


def rotary_inverse_frequencies(m: Any) -> torch.Tensor:
    """The rotary embedding's inv_freq buffer (ours and Hugging Face's alike): 1 / base^(2i / head_dim)."""
    head_dim = m.hidden_size // m.num_attention_heads
    return 1.0 / m.rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def hf_shapes(m: Any, lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of an EsmForMaskedLM with our model settings `m` that we read or write, and its shape (the
    `esm.` backbone's alone for lm_head=False)."""
    h, ffn = m.hidden_size, m.ffn_hidden_size
    shapes = {"esm.embeddings.word_embeddings.weight": (VOCAB_SIZE, h)}
    shapes |= {f"esm.encoder.emb_layer_norm_after.{kind}": (h,) for kind in ("weight", "bias")}
    if lm_head:
        shapes |= {"lm_head.bias": (VOCAB_SIZE,), "lm_head.dense.weight": (h, h), "lm_head.dense.bias": (h,)}
        shapes |= {f"lm_head.layer_norm.{kind}": (h,) for kind in ("weight", "bias")}
    for i in range(m.num_layers):
        layer = f"esm.encoder.layer.{i}."
        for name, rows, columns in (
            ("attention.self.query", h, h),
            ("attention.self.key", h, h),
            ("attention.self.value", h, h),
            ("attention.output.dense", h, h),
            ("intermediate.dense", ffn, h),
            ("output.dense", h, ffn),
        ):
            shapes |= {layer + name + ".weight": (rows, columns), layer + name + ".bias": (rows,)}
        for norm in ("attention.LayerNorm", "LayerNorm"):
            shapes |= {f"{layer}{norm}.weight": (h,), f"{layer}{norm}.bias": (h,)}
    return shapes


# Tensors of an EsmForMaskedLM folder that are not weights of our model: the contact head, buffers (rotary
# frequencies, position ids), and the decoder, which ESM-2 ties to the embedding (checked apart).
_NOT_OURS = re.compile(
    r"^esm\.contact_head\.|rotary_embeddings\.inv_freq$|^esm\.embeddings\.position_ids$|"
    r"^lm_head\.decoder\.weight$"
)


def canonical_hf_names(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LayerNorm weights by their current names: transformers still reads, and its save_pretrained of a fresh
    EsmForMaskedLM writes, the legacy `LayerNorm.gamma` / `LayerNorm.beta`."""
    return {
        re.sub(
            r"(LayerNorm|layer_norm|emb_layer_norm_after)\.(gamma|beta)$",
            lambda x: f"{x[1]}.{'weight' if x[2] == 'gamma' else 'bias'}",
            k,
        ): v
        for k, v in hf.items()
    }


def check_hf_weights(
    hf: dict[str, torch.Tensor],
    m: Any,
    settings: str = "config.json",
    outcome: str = "nothing was imported",
    head_shapes: Optional[dict[str, tuple[int, ...]]] = None,
    model_class: str = "EsmForMaskedLM",
) -> None:
    """Refuse EsmForMaskedLM weights (or, given `head_shapes`, a backbone with that head instead of the LM head)
    that do not fit the model settings `m` (from `settings`) as our ESM-2 (missing, unexpected, misshapen or
    quantized tensors), naming them; the layer count is checked first, so settings of absurd size build no table."""
    layers = layer_count(hf, "esm.encoder.layer.")
    if layers != m.num_layers:
        raise ValueError(f"{settings} gives {m.num_layers} layers, the weights hold {layers}; {outcome}")
    expected = hf_shapes(m, lm_head=head_shapes is None) | (head_shapes or {})
    problems = weight_mismatches(hf, expected, lambda k: bool(_NOT_OURS.search(k)), settings)
    if problems:
        raise ValueError(
            f"the weights do not fit {settings} as an ESM-2 {model_class} of {m.num_layers} layers: "
            + "; ".join(problems)
            + f"; {outcome}"
        )


def from_hf(
    hf: dict[str, torch.Tensor], m: Any, head_shapes: Optional[dict[str, tuple[int, ...]]] = None, **check: str
) -> dict[str, torch.Tensor]:
    """EsmForMaskedLM's state dict -> ours (the contact head dropped; checked first: every tensor we need is there,
    with our shapes, and none is left over). Given `head_shapes` (another head's tensors instead of the LM head:
    check_hf_weights), the backbone alone is converted; the head is the caller's."""
    hf = canonical_hf_names(hf)
    check_hf_weights(hf, m, head_shapes=head_shapes, **check)
    heads, head_dim, h = m.num_attention_heads, m.hidden_size // m.num_attention_heads, m.hidden_size
    names = _renames(m.num_layers, lm_head=head_shapes is None)
    out = {ours: hf[theirs].float() for ours, theirs in names.items()}
    for name in ("embedding.weight", "lm_head.bias")[: 1 if head_shapes is not None else 2]:
        padding = out[name].new_zeros(TABLE_ROWS - VOCAB_SIZE, *out[name].shape[1:])
        out[name] = torch.cat([out[name], padding])  # rows our model never reads
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.self_attention.layernorm_qkv.", f"esm.encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{theirs}{part}.{kind}"].float() for part in ("query", "key", "value"))
            if m.fuse_qkv_params:
                stacked = torch.stack([t.reshape(heads, head_dim, *t.shape[1:]) for t in (q, k, v)], dim=1)
                out[ours + kind] = stacked.reshape(3 * h, *q.shape[1:])
            else:
                out[f"{ours}query_{kind}"], out[f"{ours}key_{kind}"], out[f"{ours}value_{kind}"] = q, k, v
    out["rotary.inv_freq"] = rotary_inverse_frequencies(m)  # a buffer of our model, in its state dict
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(m: Any, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the EsmForMaskedLM our model `m` (the model config) equals."""
    return {
        "architectures": ["EsmForMaskedLM"],
        "model_type": "esm",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "intermediate_size": m.ffn_hidden_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": m.hidden_dropout,
        "attention_probs_dropout_prob": m.attention_dropout,
        "max_position_embeddings": m.max_seq_length + 2,
        "initializer_range": m.init_std,
        "layer_norm_eps": m.norm_epsilon,
        "position_embedding_type": "rotary",
        "rope_theta": m.rotary_base,
        "use_cache": True,
        "emb_layer_norm_before": False,
        "token_dropout": m.token_dropout,
        "is_folding_model": False,
        "tie_word_embeddings": True,
        "pad_token_id": PAD,
        "mask_token_id": MASK,
        "cls_token_id": CLS,
        "eos_token_id": EOS,
        "dtype": dtype,
    }


def check_esm2_config(config: dict, file: Path, fuse_qkv: bool = True) -> SimpleNamespace:
    """An EsmForMaskedLM config.json -> our model settings; refuses what our ESM-2 does not compute."""

    def need(condition: bool, what: str) -> None:
        if not condition:
            raise ValueError(f"{file}: {what}; not an ESM-2 model this recipe computes, nothing was imported")

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        value = config.get(key)
        need(isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 20, f"{key}={value!r}")
    need(config.get("model_type") == "esm", f"model_type={config.get('model_type')!r}, expected 'esm'")
    need(config.get("position_embedding_type") == "rotary", "position_embedding_type is not 'rotary' (ESM-1 style)")
    need(not config.get("emb_layer_norm_before"), "emb_layer_norm_before is set (ESM-1b style)")
    need(config.get("vocab_size") == VOCAB_SIZE, f"vocab_size={config.get('vocab_size')!r}, ESM-2's is {VOCAB_SIZE}")
    need(not config.get("is_folding_model") and not config.get("is_decoder"), "a folding or decoder model")
    need(config.get("hidden_size") % config.get("num_attention_heads") == 0, "hidden_size not divisible by the heads")
    eps, theta = config.get("layer_norm_eps", 1e-12), config.get("rope_theta", 10000.0)
    need(isinstance(eps, (int, float)) and 0 < eps < 1, f"layer_norm_eps={eps!r}")
    need(isinstance(theta, (int, float)) and 1 < theta < math.inf, f"rope_theta={theta!r}")
    return SimpleNamespace(
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        ffn_hidden_size=config["intermediate_size"],
        norm_epsilon=float(eps),
        rotary_base=float(theta),
        token_dropout=bool(config.get("token_dropout", False)),
        fuse_qkv_params=fuse_qkv,
    )


def settings_overrides(m: SimpleNamespace) -> list[str]:
    return [
        f"model.hidden_size={m.hidden_size}",
        f"model.num_layers={m.num_layers}",
        f"model.num_attention_heads={m.num_attention_heads}",
        f"model.ffn_hidden_size={m.ffn_hidden_size}",
        f"model.norm_epsilon={m.norm_epsilon}",
        f"model.rotary_base={m.rotary_base}",
        f"model.token_dropout={str(m.token_dropout).lower()}",
    ] + ([] if m.fuse_qkv_params else ["model.fuse_qkv_params=false"])


def write_tokenizer(out: Path, max_length: int) -> list[str]:
    """EsmTokenizer's files: vocab.txt (one token per line, id order) and tokenizer_config.json."""
    (out / "vocab.txt").write_text("\n".join(VOCABULARY))
    specials = {
        "cls_token": "<cls>",
        "pad_token": "<pad>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "EsmTokenizer", "model_max_length": max_length, **specials}, indent=2) + "\n"
    )
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return ["vocab.txt", "tokenizer_config.json", "special_tokens_map.json"]


def export_to_hf(
    source: str, out_dir: str, verify_checksums: bool = True, dtype: str = "float32", config: Optional[str] = None
) -> dict:
    """checkpoint.py to-hf for an ESM-2 run: a step folder (or weights file + its run's config) -> a folder that
    EsmForMaskedLM.from_pretrained and EsmTokenizer.from_pretrained load. Returns the written config.json."""
    from core.checkpointing.hf_folders import read_run
    from core.checkpointing.layout import CheckpointError
    from core.checkpointing.output_files import save_safetensors
    from recipes.registry import get_recipe

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new folder")
    saved, weights = read_run(Path(source), config, verify_checksums, "esm2", get_recipe)
    m = SimpleNamespace(**saved.section("model"))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = {k: v.to(torch_dtype) for k, v in to_hf(weights, m).items() if k != "lm_head.decoder.weight"}  # tied
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(hf, out / "model.safetensors", metadata={"format": "pt"})
    written = hf_config(m, dtype)
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    files = write_tokenizer(out, m.max_seq_length)
    note = (
        ""
        if m.activation == "gelu_erf"
        else "; trained with TE's GELU (tanh form), which EsmForMaskedLM "
        "computes exactly (erf): its logits differ a little (docs/esm2.md)"
    )
    print(
        f"wrote {out}: EsmForMaskedLM, {sum(v.numel() for v in hf.values()):,} parameters ({dtype}), "
        f"{len(hf)} tensors; {', '.join(files)}{note}"
    )
    return written


# The run's model settings that must equal an EsmForMaskedLM folder's config.json for checkpoint.init_from.
SETTINGS = (
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "ffn_hidden_size",
    "norm_epsilon",
    "rotary_base",
    "token_dropout",
)


def weights_from_hf_folder(folder: Path, model: Any) -> dict[str, torch.Tensor]:
    """checkpoint.init_from=<an EsmForMaskedLM folder>: our weights, converted in memory (nothing written), when the
    run's model settings `model` are the folder's config.json's; ValueError naming the keys that differ. The caller
    reads safetensors folders only (core/checkpointing/weights.py)."""
    from core.checkpointing.hf_folders import read_hf_weights, read_json_object

    file = Path(folder) / "config.json"
    m = check_esm2_config(read_json_object(file), file, bool(model.fuse_qkv_params))
    differ = [
        f"model.{key}={getattr(model, key)!r} (config.json: {getattr(m, key)!r})"
        for key in SETTINGS
        if getattr(model, key) != getattr(m, key)
    ]
    if differ:
        raise ValueError(
            f"the run's model settings differ from {file}'s: {', '.join(differ)}; set them as the folder has them"
        )
    hf = {k: v.float() if v.is_floating_point() else v for k, v in read_hf_weights(Path(folder)).items()}
    if "lm_head.decoder.weight" in hf and not torch.equal(
        hf["lm_head.decoder.weight"], hf["esm.embeddings.word_embeddings.weight"]
    ):
        raise ValueError("lm_head.decoder.weight differs from the embedding: ESM-2 ties them")
    return from_hf(hf, model)


def import_from_hf(hf_dir: str, out: str, fuse_qkv: bool = True) -> list[str]:
    """checkpoint.py from-hf for an EsmForMaskedLM folder (e.g. a local copy of facebook/esm2_t33_650M_UR50D) -> our
    weights as a .safetensors/.pt file or a step folder (checkpoint.init_from). Returns the model settings."""
    from core.checkpointing.hf_folders import read_hf_folder, write_weights

    folder, target, config, hf = read_hf_folder(hf_dir, out)
    m = check_esm2_config(config, folder / "config.json", fuse_qkv)
    weights = from_hf(hf, m)
    if "lm_head.decoder.weight" in hf and not torch.equal(
        hf["lm_head.decoder.weight"], hf["esm.embeddings.word_embeddings.weight"]
    ):
        raise ValueError("lm_head.decoder.weight differs from the embedding: ESM-2 ties them; nothing was imported")
    write_weights(weights, target, str(folder))
    settings = settings_overrides(m)
    if target.suffix in (".safetensors", ".pt", ".pth"):  # a step folder's writer prints its own line
        print(f"wrote {len(weights)} tensors to {target}")
    print(
        f"train, fine-tune or predict with: recipe=esm2 {override('checkpoint.init_from', target)} {' '.join(settings)}"
    )
    return settings
