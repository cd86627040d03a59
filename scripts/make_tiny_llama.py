"""Build data/tiny_llama/: a tiny Llama in Hugging Face format (LlamaForCausalLM + a tokenizer with a Llama-3-style
chat template), for CPU tests and the gpt_sft_sanity config. Random weights: it knows nothing.

    python scripts/make_tiny_llama.py [--text data/chat_sanity/train.jsonl ...] [--out data/tiny_llama]

--text: the files the tokenizer is trained on: chat rows (.jsonl: {"messages": [{"role", "content"}, ...]} or
{"prompt", "response"}: their texts and roles) or plain text (.txt). Deterministic: the same inputs give the same
files byte for byte (tests/recipes/gpt/test_tiny_llama.py checks the shipped folder against a rebuild).

    config.json         LlamaForCausalLM: hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocabulary the
                        tokenizer's rounded up to a multiple of 128 (what the GPT recipe pads it to), rope_theta 10000,
                        untied output layer
    model.safetensors   fp32, drawn from a seeded generator, each matrix N(0, 1/fan_in) and the embedding N(0, 1) (so
                        activations stay near unit size and attention is far from uniform: a test that compares logits
                        sees a head mapped wrong), norm weights 1 + N(0, 0.1^2) (so a swapped norm shows too)
    tokenizer.json      a byte-level BPE (Llama 3's pre-tokenizer split, so "\\n\\n" before a message's text tokenizes
                        the same alone and in a conversation) of VOCAB tokens, then the special tokens
    tokenizer_config.json   eos_token <|eot_id|> (the end of a turn), bos_token <|begin_of_text|>, and the chat template
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from core.checkpointing.output_files import save_safetensors  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BYTES_AND_MERGES = 507  # + the 5 special tokens: 512 ids
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's pre-tokenizer split: letters with one leading non-letter, numbers of up to 3 digits, punctuation runs,
# newline runs kept whole.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3 Instruct's template: the first turn after <|begin_of_text|>, each turn a header and its trimmed text, then
# <|eot_id|>; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
INTERMEDIATE, SEQUENCE, SEED = 128, 1024, 52


def texts(files: list[Path]) -> list[str]:
    """The training text of each input: a chat row's roles and texts, a .txt file's lines."""
    out = []
    for file in files:
        if file.suffix == ".txt":
            out += file.read_text(encoding="utf-8").splitlines()
            continue
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            messages = row.get("messages") or [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["response"]},
            ]
            for message in messages:
                out += [message["role"], message["content"]]
    if not out:
        raise SystemExit(f"no text in {', '.join(map(str, files))}")
    return out


def build_tokenizer(corpus: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BYTES_AND_MERGES, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    return tokenizer


def tokenizer_config(tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIALS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "added_tokens_decoder": added,
        "model_max_length": SEQUENCE,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def llama_config(vocab: int, tokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        **SHAPE,
        "intermediate_size": INTERMEDIATE,
        "head_dim": SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": SEQUENCE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": tokenizer.token_to_id("<|begin_of_text|>"),
        "eos_token_id": tokenizer.token_to_id("<|eot_id|>"),
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def weights(vocab: int) -> dict[str, torch.Tensor]:
    """Every LlamaForCausalLM tensor of this shape, drawn in name order from one seeded generator."""
    h, heads, groups = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    kv = groups * h // heads
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(SHAPE["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (h,),
            layer + "post_attention_layernorm.weight": (h,),
            layer + "self_attn.q_proj.weight": (h, h),
            layer + "self_attn.k_proj.weight": (kv, h),
            layer + "self_attn.v_proj.weight": (kv, h),
            layer + "self_attn.o_proj.weight": (h, h),
            layer + "mlp.gate_proj.weight": (INTERMEDIATE, h),
            layer + "mlp.up_proj.weight": (INTERMEDIATE, h),
            layer + "mlp.down_proj.weight": (h, INTERMEDIATE),
        }
    generator = torch.Generator().manual_seed(SEED)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if len(shape) == 1:
            out[name] = 1 + 0.1 * noise
        elif name == "model.embed_tokens.weight":
            out[name] = noise
        else:
            out[name] = noise / math.sqrt(shape[1])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--text",
        nargs="+",
        default=[str(REPO / "data/chat_sanity/train.jsonl")],
        help="chat rows (.jsonl) or plain text (.txt) the tokenizer is trained on",
    )
    parser.add_argument("--out", default=str(REPO / "data/tiny_llama"))
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(texts([Path(f) for f in args.text]))
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    vocab = (max(ids) + 1 + 127) // 128 * 128
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(llama_config(vocab, tokenizer), indent=2) + "\n")
    save_safetensors(weights(vocab), out / "model.safetensors", metadata={"format": "pt"})
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out}: LlamaForCausalLM, vocabulary {vocab} ({len(ids)} tokens), {size:,} bytes")


if __name__ == "__main__":
    main()
