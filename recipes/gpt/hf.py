"""The GPT recipe's weights to and from Hugging Face Llama folders (`LlamaForCausalLM`).

The model is Llama-shaped: RMSNorm before attention and MLP, rotary positions in the rotate-half layout,
grouped-query attention, SwiGLU, no biases. What differs is how weights are packed:

    ours (TE's names)                                   Llama
    embedding.weight                                    model.embed_tokens.weight
    layers.i.self_attention.layernorm_qkv.layer_norm_weight   model.layers.i.input_layernorm.weight
    layers.i.self_attention.layernorm_qkv.weight        q_proj, k_proj, v_proj (rows grouped per KV group as
                                                        [the group's query heads, its key, its value])
      (or .query_weight / .key_weight / .value_weight with model.fuse_qkv_params=false)
    layers.i.self_attention.proj.weight                 model.layers.i.self_attn.o_proj.weight
    layers.i.layernorm_mlp.layer_norm_weight            model.layers.i.post_attention_layernorm.weight
    layers.i.layernorm_mlp.fc1_weight                   [gate_proj; up_proj]
    layers.i.layernorm_mlp.fc2_weight                   down_proj
    final_norm.weight                                   model.norm.weight
    output_layer.weight (untied)                        lm_head.weight (tie_word_embeddings: none)

Checkpoints hold full tensors in the TP=1 layout whatever the training's tensor parallelism, so a TP=2
step folder exports the same way. Writing needs only json and safetensors; `transformers` is needed to
load the result, not to make it. Importing refuses a config.json this model does not compute (biases,
RoPE scaling, another head_dim, ...) or whose fields have the wrong type or range, an index naming shard
files outside the folder, and tensors that do not fit, naming the file and the field or tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.checkpointing.hf_folders import (
    layer_count,
    override,
    read_hf_folder,
    read_run,
    weight_mismatches,
    write_weights,
)
from core.config.file_shape import problems
from recipes.gpt.config import GPTModelConfig

# The config.json model_type values import_from_hf reads (checkpoint.py from-hf picks the recipe by them).
HF_MODEL_TYPES = ("llama",)
SHAPE_KEYS = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # where transformers saves a chat template besides tokenizer_config.json
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)


def _heads(m: dict) -> tuple[int, int, int]:
    heads = m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    return heads, groups, m["hidden_size"] // heads


def _qkv_rows(m: dict) -> list[tuple[str, int, int]]:
    """(which, group, rows) blocks of the fused QKV weight, top to bottom."""
    heads, groups, head_dim = _heads(m)
    per_group = heads // groups
    return [
        block
        for g in range(groups)
        for block in (("q", g, per_group * head_dim), ("k", g, head_dim), ("v", g, head_dim))
    ]


def to_llama(weights: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """Our full weights (by canonical name) -> Llama's names and layouts."""
    heads, groups, head_dim = _heads(m)
    ffn = m["ffn_hidden_size"]
    out = {"model.embed_tokens.weight": weights["embedding.weight"], "model.norm.weight": weights["final_norm.weight"]}
    if not m["tie_embeddings"]:
        out["lm_head.weight"] = weights["output_layer.weight"]
    for i in range(m["num_layers"]):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attention = ours + "self_attention."
        if attention + "layernorm_qkv.weight" in weights:
            parts = {"q": [], "k": [], "v": []}
            for (which, _, rows), block in zip(
                _qkv_rows(m), weights[attention + "layernorm_qkv.weight"].split([rows for _, _, rows in _qkv_rows(m)])
            ):
                parts[which].append(block)
            q, k, v = (torch.cat(parts[w]) for w in "qkv")
        else:
            q, k, v = (weights[attention + f"layernorm_qkv.{w}_weight"] for w in ("query", "key", "value"))
        fc1 = weights[ours + "layernorm_mlp.fc1_weight"]
        out |= {
            theirs + "input_layernorm.weight": weights[attention + "layernorm_qkv.layer_norm_weight"],
            theirs + "self_attn.q_proj.weight": q,
            theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": weights[attention + "proj.weight"],
            theirs + "post_attention_layernorm.weight": weights[ours + "layernorm_mlp.layer_norm_weight"],
            theirs + "mlp.gate_proj.weight": fc1[:ffn],
            theirs + "mlp.up_proj.weight": fc1[ffn:],
            theirs + "mlp.down_proj.weight": weights[ours + "layernorm_mlp.fc2_weight"],
        }
    if heads * head_dim != m["hidden_size"] or q.shape[0] != heads * head_dim or k.shape[0] != groups * head_dim:
        raise ValueError("the checkpoint's attention weights do not fit its model config")
    return {k: v.contiguous() for k, v in out.items()}


def to_llama_checked(weights: dict[str, torch.Tensor], m: dict, vocab_size: int) -> dict[str, torch.Tensor]:
    """to_llama, refused with the tensors named where the weights do not fit the model settings `m` (a weights file
    given with another run's or another recipe's config)."""
    layers = layer_count(weights, "layers.")
    if layers != m["num_layers"]:
        raise ValueError(f"the config gives model.num_layers={m['num_layers']}, the weights hold {layers} layers")
    try:
        hf = to_llama(weights, m)
    except KeyError as e:
        raise ValueError(f"the weights are not a GPT model of this config: no tensor {e}") from None
    check_llama_weights(hf, m | {"vocab_size": vocab_size})
    return hf


def llama_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a LlamaForCausalLM with our model settings `m`, and its shape."""
    heads, groups, head_dim = _heads(m)
    h, ffn, vocab = m["hidden_size"], m["ffn_hidden_size"], m["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not m["tie_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(m["num_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (h,),
            layer + "post_attention_layernorm.weight": (h,),
            layer + "self_attn.q_proj.weight": (heads * head_dim, h),
            layer + "self_attn.k_proj.weight": (groups * head_dim, h),
            layer + "self_attn.v_proj.weight": (groups * head_dim, h),
            layer + "self_attn.o_proj.weight": (h, heads * head_dim),
            layer + "mlp.gate_proj.weight": (ffn, h),
            layer + "mlp.up_proj.weight": (ffn, h),
            layer + "mlp.down_proj.weight": (h, ffn),
        }
    return shapes


def check_llama_weights(hf: dict[str, torch.Tensor], m: dict) -> None:
    """Refuse weights that do not fit config.json (missing, unexpected, misshapen or quantized tensors), naming
    them; the layer count is checked first, so a config.json of absurd size builds no table."""
    layers = layer_count(hf, "model.layers.")
    if layers != m["num_layers"]:
        raise ValueError(
            f"the weights do not fit config.json as a Llama: it gives {m['num_layers']} layers, the "
            f"weights hold {layers}"
        )
    # Tied models may still store lm_head (a copy of the embedding); old exports stored RoPE's inv_freq.
    tied_copy = "lm_head.weight" if m["tie_embeddings"] else None
    problems = weight_mismatches(
        hf, llama_shapes(m), lambda k: k == tied_copy or k.endswith("rotary_emb.inv_freq"), "config.json"
    )
    if problems:
        raise ValueError("the weights do not fit config.json as a Llama: " + "; ".join(problems))


def from_llama(hf: dict[str, torch.Tensor], m: dict, fuse_qkv: bool = True) -> dict[str, torch.Tensor]:
    """Llama's weights -> ours (canonical names), for the model settings `m` (see `model_settings`)."""
    check_llama_weights(hf, m)
    heads, groups, head_dim = _heads(m)
    out = {
        "embedding.weight": hf["model.embed_tokens.weight"],
        "final_norm.weight": hf["model.norm.weight"],
        "rotary.inv_freq": 1.0 / m["rotary_base"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
    }
    if not m["tie_embeddings"]:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(m["num_layers"]):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = (hf[theirs + f"self_attn.{w}_proj.weight"] for w in "qkv")
        attention = ours + "self_attention.layernorm_qkv."
        if fuse_qkv:  # TE's fused layout: per KV group, its query heads, then its key and value head
            per_group = heads // groups
            q_groups, k_groups, v_groups = q.split(per_group * head_dim), k.split(head_dim), v.split(head_dim)
            out[attention + "weight"] = torch.cat(
                [t for g in range(groups) for t in (q_groups[g], k_groups[g], v_groups[g])]
            )
        else:
            out |= {attention + "query_weight": q, attention + "key_weight": k, attention + "value_weight": v}
        out |= {
            attention + "layer_norm_weight": hf[theirs + "input_layernorm.weight"],
            ours + "self_attention.proj.weight": hf[theirs + "self_attn.o_proj.weight"],
            ours + "layernorm_mlp.layer_norm_weight": hf[theirs + "post_attention_layernorm.weight"],
            ours + "layernorm_mlp.fc1_weight": torch.cat(
                [hf[theirs + "mlp.gate_proj.weight"], hf[theirs + "mlp.up_proj.weight"]]
            ),
            ours + "layernorm_mlp.fc2_weight": hf[theirs + "mlp.down_proj.weight"],
        }
    return {k: v.contiguous() for k, v in out.items()}


def llama_config(m: dict, vocab_size: int, specials: dict[str, Optional[int]], dtype: str) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with our model settings `m`."""
    heads, groups, head_dim = _heads(m)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": m["hidden_size"],
        "intermediate_size": m["ffn_hidden_size"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m["seq_length"],
        "rms_norm_eps": m["norm_epsilon"],
        "tie_word_embeddings": bool(m["tie_embeddings"]),
        # transformers 5 reads rope_parameters; older readers (transformers 4, vLLM) rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": m["rotary_base"]},
        "rope_theta": m["rotary_base"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": m["init_std"],
        "bos_token_id": specials.get("bos"),
        "eos_token_id": specials.get("eos"),
        "pad_token_id": specials.get("pad"),
        # transformers 5 reads dtype; older readers torch_dtype.
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


Count = Annotated[int, Field(ge=1, le=2**31 - 1)]  # a size: what an int32 holds
PositiveReal = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


class RopeParameters(BaseModel):
    """rope_parameters (transformers 5) or rope_scaling (older): the fields model_settings reads."""

    model_config = ConfigDict(strict=True)
    rope_type: Optional[str] = None
    type: Optional[str] = None  # rope_type's older name
    rope_theta: Optional[PositiveReal] = None
    partial_rotary_factor: Optional[Fraction] = None


class LlamaConfigFields(BaseModel):
    """The fields of a Llama config.json that model_settings reads, with their types and ranges (the others
    are not read). Strict: 64.0 is not a size, 1 is not a boolean."""

    model_config = ConfigDict(strict=True)
    vocab_size: Count
    hidden_size: Count
    intermediate_size: Count
    num_hidden_layers: Count
    num_attention_heads: Count
    num_key_value_heads: Optional[Count] = None  # null: one per attention head
    head_dim: Optional[Count] = None  # null: hidden_size / num_attention_heads
    max_position_embeddings: Count = 2048
    rope_theta: Optional[PositiveReal] = None
    rope_parameters: Optional[RopeParameters] = None
    rope_scaling: Optional[RopeParameters] = None
    partial_rotary_factor: Optional[Fraction] = None
    rms_norm_eps: PositiveReal = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.02
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"


def model_settings(config: dict, file: Path | str = "config.json") -> dict[str, Any]:
    """A Llama config.json (`file`, for messages) -> our model settings; refuses a field of the wrong type or
    out of range, and what our model does not compute, naming the field."""

    def refuse(field: str, value, want) -> None:
        raise ValueError(f"{file}: {field}={value!r}, but the GPT recipe's model needs {want}")

    if config.get("model_type") != "llama":
        refuse("model_type", config.get("model_type"), "'llama'")
    try:
        fields = LlamaConfigFields.model_validate(config)
    except ValidationError as e:
        raise ValueError(f"{file}: {problems(e)}; nothing was imported") from None
    for field, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if getattr(fields, field) != want:
            refuse(field, getattr(fields, field), repr(want))
    rope = fields.rope_parameters or fields.rope_scaling or RopeParameters()
    rope_type = rope.rope_type or rope.type or "default"
    if rope_type != "default":
        refuse("rope_parameters.rope_type", rope_type, "'default' (no RoPE scaling)")
    partial = rope.partial_rotary_factor or fields.partial_rotary_factor or 1.0
    if partial != 1.0:
        refuse("partial_rotary_factor", partial, "1.0 (rotary positions over the whole head)")
    heads, hidden = fields.num_attention_heads, fields.hidden_size
    if fields.head_dim not in (None, hidden // heads) or hidden % heads:
        refuse("head_dim", fields.head_dim, f"hidden_size / num_attention_heads = {hidden / heads:g}")
    groups = fields.num_key_value_heads or heads
    if heads % groups:
        refuse("num_key_value_heads", groups, f"a divisor of num_attention_heads={heads}")
    rope_theta = next((t for t in (rope.rope_theta, fields.rope_theta) if t is not None), 10000.0)
    settings = {
        "vocab_size": fields.vocab_size,
        "seq_length": fields.max_position_embeddings,
        "hidden_size": hidden,
        "num_layers": fields.num_hidden_layers,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "ffn_hidden_size": fields.intermediate_size,
        "rotary_base": float(rope_theta),
        "norm_epsilon": fields.rms_norm_eps,
        "tie_embeddings": fields.tie_word_embeddings,
        "init_std": fields.initializer_range,
    }
    # The settings become model.<key> on the command line printed for training, which applies the GPT schema's
    # ranges: refuse here, naming the config.json field, what training would refuse.
    for key, field in LLAMA_FIELDS.items():
        rule = GPTModelConfig.RANGES.get(key)
        if rule is not None and not rule.accepts(settings[key]):
            refuse(field, settings[key], f"{rule.expected(key)} (it becomes model.{key})")
    return settings


# Our model settings and the config.json fields they come from.
LLAMA_FIELDS = {
    "vocab_size": "vocab_size",
    "seq_length": "max_position_embeddings",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "rotary_base": "rope_theta",
    "norm_epsilon": "rms_norm_eps",
    "init_std": "initializer_range",
}


def overrides(settings: dict[str, Any]) -> list[str]:
    """The command-line settings that build our model in the shape of an imported Llama."""
    keys = ("vocab_size", "seq_length", *SHAPE_KEYS, "rotary_base", "norm_epsilon", "tie_embeddings")
    return [f"model.{k}={str(settings[k]).lower() if isinstance(settings[k], bool) else settings[k]}" for k in keys]


def byte_level_characters() -> list[str]:
    """The printable character that stands for each byte in byte-level BPE vocabularies (GPT-2's scheme, which
    the `tokenizers` library's ByteLevel pre-tokenizer and decoder use): printable Latin-1 bytes stand for
    themselves, the others for characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    characters, extra = [], 0
    for byte in range(256):
        if byte in printable:
            characters.append(chr(byte))
        else:
            characters.append(chr(256 + extra))
            extra += 1
    return characters


def write_byte_tokenizer(out: Path, eod: int, pad: int) -> list[str]:
    """tokenizer.json (+ tokenizer_config.json) for the byte tokenizer: ids 0-255 the UTF-8 bytes, `eod` and
    `pad` special tokens, so Hugging Face tools (AutoTokenizer, pipelines, vLLM) read and write our ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {character: byte for byte, character in enumerate(byte_level_characters())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = {eod: "<|endoftext|>", pad: "<pad>"}
    tokenizer.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    if [tokenizer.token_to_id(specials[i]) for i in sorted(specials)] != sorted(specials):
        raise RuntimeError(f"the byte tokenizer's special tokens did not get ids {sorted(specials)}")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": specials[eod],
                "pad_token": specials[pad],
                "model_max_length": 1 << 30,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    return ["tokenizer.json", "tokenizer_config.json"]


def tokenizer_file(spec: str) -> Path:
    """data.tokenizer (a local Hugging Face tokenizer folder, or its tokenizer.json) -> its tokenizer.json."""
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def declared_special_ids(file: Path) -> dict[str, int]:
    """The bos and pad ids a Hugging Face tokenizer folder declares (tokenizer_config.json, then
    special_tokens_map.json), where their tokens are in its vocabulary."""
    from tokenizers import Tokenizer

    from recipes.gpt.tokenizer import SETTINGS_FILES, read_settings_file

    vocabulary = Tokenizer.from_file(str(file))
    found: dict[str, int] = {}
    for config in SETTINGS_FILES:
        if not (file.parent / config).is_file():
            continue
        declared = read_settings_file(file.parent / config)
        for name in ("bos", "pad"):
            token = declared.get(f"{name}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if name not in found and isinstance(token, str) and vocabulary.token_to_id(token) is not None:
                found[name] = vocabulary.token_to_id(token)
    return found


# --- checkpoint.init_from=<a Hugging Face Llama folder> -----------------------------------------------------------
# The run's model settings that must be config.json's: the shapes, and what the numerics depend on.
INIT_SETTINGS = (*SHAPE_KEYS, "vocab_size", "rotary_base", "norm_epsilon", "tie_embeddings")


def weights_from_hf_folder(folder: Path, model: Any) -> dict[str, torch.Tensor]:
    """checkpoint.init_from=<a LlamaForCausalLM folder>: our weights (fp32), converted in memory (nothing written),
    when the run's model settings `model` (cfg.model) are the folder's config.json's: ConfigError naming each key that
    differs (model.vocab_size=null, the tokenizer's padded vocabulary, is checked by the load against the embedding).
    Safetensors only: a folder with only a pickled pytorch_model.bin is refused, never unpickled."""
    from core.checkpointing.hf_folders import read_hf_weights, read_json_object
    from core.config.errors import ConfigError

    folder = Path(folder)
    file = folder / "config.json"
    settings = model_settings(read_json_object(file), file)
    ours = {key: getattr(model, key) for key in INIT_SETTINGS}
    ours["num_query_groups"] = ours["num_query_groups"] or ours["num_attention_heads"]
    if ours["vocab_size"] is None:
        ours["vocab_size"] = settings["vocab_size"]
    differ = [key for key in INIT_SETTINGS if ours[key] != settings[key]]
    if differ:
        field = {**LLAMA_FIELDS, "tie_embeddings": "tie_word_embeddings"}
        named = [f"model.{k}={ours[k]!r} ({file.name}: {field[k]}={settings[k]!r})" for k in differ]
        fixes = [f for f in overrides(settings) if f.split("=", 1)[0].removeprefix("model.") in differ]
        raise ConfigError(
            f"checkpoint.init_from={folder}: the run's model settings differ from {file}'s: {', '.join(named)}; "
            f"set them as the folder has them: {' '.join(fixes)}"
        )
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise ConfigError(
            f"checkpoint.init_from={folder}: no model.safetensors (or its index); pickled weights "
            "(pytorch_model.bin) are never loaded: save the model with save_pretrained(..., safe_serialization=True)"
        )
    hf = {k: v.float() if v.is_floating_point() else v for k, v in read_hf_weights(folder).items()}
    if settings["tie_embeddings"] and "lm_head.weight" in hf:
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise ValueError(f"{file} says tie_word_embeddings, but lm_head.weight differs from the embedding")
        del hf["lm_head.weight"]
    return from_llama(hf, settings, bool(model.fuse_qkv_params))


# --- the two commands -------------------------------------------------------------------------------


def export_to_hf(
    source: str,
    out_dir: str,
    verify_checksums: bool = True,
    dtype: str = "float32",
    config: Optional[str] = None,
    adapter: bool = False,
) -> dict:
    """checkpoint.py to-hf: a GPT step folder (or weights file + its run's config) -> a folder that
    LlamaForCausalLM.from_pretrained loads, LoRA merged, with the tokenizer's files (its chat template too); with
    `adapter`, a PEFT LoRA adapter for the Llama the run started from instead. Returns the written config.json."""
    from core.checkpointing.hf_folders import lora_settings
    from core.checkpointing.layout import CheckpointError
    from core.checkpointing.output_files import save_safetensors
    from core.layers.lora import merge_lora_weights
    from recipes.registry import get_recipe

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new folder")
    saved, weights = read_run(Path(source), config, verify_checksums, "gpt", get_recipe, data_keys=("format",))
    model_cfg, data = saved.section("model"), saved.section("data")
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}  # LoRA's frozen base: bf16
    ranks = {v.shape[0] for k, v in weights.items() if k.endswith(".lora_A.weight")}
    lora = lora_settings(saved.file) if ranks else None
    if lora is not None and ranks != {lora["rank"]}:
        raise ValueError(
            f"{saved.file}: finetune.lora.rank={lora['rank']}, the weights' LoRA ranks are {sorted(ranks)}"
        )
    if adapter:
        if lora is None:
            raise CheckpointError(f"{source}: no LoRA weights (finetune.mode is not lora): leave out --adapter")
        return export_adapter(weights, model_cfg, lora, out, saved)
    if lora is not None:
        weights = merge_lora_weights(weights, lora["alpha"] / lora["rank"])
    vocab_size = weights["embedding.weight"].shape[0]  # the padded vocabulary the model was built with
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = {k: v.to(torch_dtype) for k, v in to_llama_checked(weights, model_cfg, vocab_size).items()}
    out.mkdir(parents=True, exist_ok=True)
    specials, copied, tokenizer_note = write_tokenizer_files(out, data)
    save_safetensors(hf, out / "model.safetensors", metadata={"format": "pt"})
    written = llama_config(model_cfg, vocab_size, specials, dtype)
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    print(
        f"wrote {out}: LlamaForCausalLM{', LoRA merged' if lora else ''}, {sum(v.numel() for v in hf.values()):,} "
        f"parameters ({dtype}), {len(hf)} tensors{tokenizer_note}" + (f"; wrote {', '.join(copied)}" if copied else "")
    )
    return written


def write_tokenizer_files(out: Path, data: dict) -> tuple[dict[str, Optional[int]], list[str], str]:
    """The run's tokenizer into `out`: the byte tokenizer written as a tokenizer.json, a Hugging Face folder's files
    copied (its chat template with them); mock data has none. Returns (special ids for config.json, the files, a
    note for the printed line)."""
    from recipes.gpt.tokenizer import build_tokenizer

    if data["format"] == "mock":  # synthetic ids, no tokenizer
        return {}, [], ""
    tokenizer = build_tokenizer(data["tokenizer"], data["eod_token"])
    specials: dict[str, Optional[int]] = {"eos": tokenizer.eod}
    if data["tokenizer"] == "byte":
        specials["pad"] = tokenizer.pad  # a real id of the byte tokenizer.json written here
        note = (
            f"; tokenizer byte (ids 0-255 = UTF-8 bytes, end of document = id {tokenizer.eod}, "
            f"padding = id {tokenizer.pad})"
        )
        return specials, write_byte_tokenizer(out, tokenizer.eod, tokenizer.pad), note
    # the folder's own bos/pad tokens; its pad id in the data pipeline is no token at all
    specials |= declared_special_ids(tokenizer_file(data["tokenizer"]))
    folder, copied = tokenizer_file(data["tokenizer"]).parent, []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)  # the umask's mode, not the source's
            copied.append(name)
    return specials, copied, f"; tokenizer {data['tokenizer']} (end of document = id {tokenizer.eod})"


def export_adapter(weights: dict[str, torch.Tensor], m: dict, lora: dict, out: Path, saved: Any = None) -> dict:
    """to-hf --adapter: adapter_config.json + adapter_model.safetensors (recipes/gpt/hf_adapter.py) for the
    LlamaForCausalLM the run started from (its checkpoint.init_from, when that is a Hugging Face folder)."""
    from core.checkpointing.hf_folders import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from core.checkpointing.output_files import save_safetensors
    from recipes.gpt.hf_adapter import adapter_config, adapter_to_peft

    tensors, targets = adapter_to_peft(weights, m)
    base = _hf_init_from(saved.file) if saved is not None else None
    written = adapter_config(lora, targets, base)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(written, indent=2) + "\n")
    print(
        f"wrote {out}: a PEFT LoRA adapter (r={lora['rank']}, alpha={lora['alpha']:g}, {len(tensors)} tensors on "
        f"{', '.join(targets)}) for the LlamaForCausalLM {base or 'the run started from'}: "
        "PeftModel.from_pretrained(base, folder)"
    )
    return written


def _hf_init_from(file: Path) -> Optional[str]:
    """A run's checkpoint.init_from when it is a Hugging Face folder (config.json beside its weights), else None."""
    from core.checkpointing.saved_config import read_config_file
    from core.checkpointing.weights import is_hf_folder

    checkpoint = read_config_file(file).get("checkpoint")
    init_from = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
    return str(Path(init_from).resolve()) if isinstance(init_from, str) and is_hf_folder(Path(init_from)) else None


def import_from_hf(hf_dir: str, out: str, fuse_qkv: bool = True) -> list[str]:
    """checkpoint.py from-hf: a Llama folder -> our weights, as a .safetensors/.pt file or a step folder
    (what checkpoint.init_from takes). Returns (and prints) the model settings that fit them."""
    folder, target, config, hf = read_hf_folder(hf_dir, out)
    settings = model_settings(config, folder / "config.json")
    weights = from_llama(hf, settings, fuse_qkv)
    if (
        settings["tie_embeddings"]
        and "lm_head.weight" in hf
        and not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"])
    ):
        raise ValueError("config.json says tie_word_embeddings, but lm_head.weight differs from the embedding")
    write_weights(weights, target, str(folder))
    settings_line = " ".join(overrides(settings) + ([] if fuse_qkv else ["model.fuse_qkv_params=false"]))
    tokenizer = f" {override('data.tokenizer', folder)}" if (folder / "tokenizer.json").is_file() else ""
    print(
        f"wrote {len(weights)} tensors to {target}\n"
        f"train, predict or generate with: {override('checkpoint.init_from', target)} {settings_line}{tokenizer}"
    )
    return overrides(settings)


def import_adapter_from_hf(adapter_dir: str, base_dir: str, out: str, fuse_qkv: bool = True) -> list[str]:
    """checkpoint.py from-hf <PEFT adapter> --base <HF Llama folder>: the base's weights with the adapter's LoRA
    (unmerged: checkpoint.init_from with finetune.mode=lora trains on; recipes/gpt/hf_adapter.py) -> our weights;
    prints and returns the settings (finetune.lora's too)."""
    from core.checkpointing.hf_folders import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        check_adapter_config,
        check_adapter_targets,
        our_lora_alpha,
        read_adapter,
    )
    from recipes.gpt.hf_adapter import lora_from_peft

    folder = Path(adapter_dir)
    config, tensors, _ = read_adapter(folder, "gpt")
    r, alpha = check_adapter_config(config, folder / ADAPTER_CONFIG)
    check_adapter_targets(config, tensors, folder)
    base, target, base_config, hf = read_hf_folder(base_dir, out)
    settings = model_settings(base_config, base / "config.json")
    lora, rank = lora_from_peft(tensors, r, settings, fuse_qkv, folder / ADAPTER_WEIGHTS)
    our_alpha = our_lora_alpha(r, alpha, rank, folder / ADAPTER_CONFIG)
    weights = from_llama(hf, settings, fuse_qkv) | lora
    write_weights(weights, target, str(folder))
    modules = [
        m for m, key in (("layernorm_qkv", ".layernorm_qkv."), ("proj", ".proj.")) if any(key in k for k in lora)
    ]
    dropout = config.get("lora_dropout", 0.0)
    settings_line = overrides(settings) + ([] if fuse_qkv else ["model.fuse_qkv_params=false"])
    settings_line += [
        "finetune.mode=lora",
        "finetune.head=[]",
        f"finetune.lora.rank={rank}",
        f"finetune.lora.alpha={our_alpha:g}",
        f"finetune.lora.target_modules=[{','.join(modules)}]",
    ] + ([f"finetune.lora.dropout={dropout:g}"] if isinstance(dropout, (int, float)) and 0 < dropout < 1 else [])
    tokenizer = f" {override('data.tokenizer', base)}" if (base / "tokenizer.json").is_file() else ""
    print(
        f"wrote {len(weights)} tensors to {target} (LoRA rank {rank} from r={r})\n"
        f"train, predict or generate with: {override('checkpoint.init_from', target)} {' '.join(settings_line)}"
        f"{tokenizer}"
    )
    return settings_line
