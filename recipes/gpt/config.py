"""Schemas of the GPT recipe's `model` and `data` config groups."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Optional

from omegaconf import MISSING

from core.config.errors import require
from core.config.ranges import INT32_MAX, Int, Numbers, Real, Rule
from core.config.schema import DataConfig, ModelConfig


class TextFormat(StrEnum):
    text = "text"  # raw text files (.txt / .jsonl / .parquet) tokenized on first use into cache_dir
    indexed = "indexed"  # Megatron .bin/.idx datasets (`python -m recipes.gpt.preprocess`), blended by weights
    mock = "mock"  # Megatron-Core's MockGPTDataset (synthetic, for throughput)


class TextDocument(StrEnum):
    """What one document of a .txt file is."""

    paragraph = "paragraph"
    line = "line"
    file = "file"


@dataclass
class GPTModelConfig(ModelConfig):
    # null: the tokenizer's vocabulary, rounded up to a multiple of make_vocab_size_divisible_by
    # (mock data: must be given).
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    seq_length: int = MISSING  # tokens per sample
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: Optional[int] = None  # grouped-query attention: key/value heads; null = num_attention_heads
    ffn_hidden_size: int = MISSING  # SwiGLU width (fc1 holds gate and up: 2 x this)
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False  # the output projection reuses the token embedding
    init_std: float = 0.02  # output projections of the blocks use init_std / sqrt(2 num_layers)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    fuse_qkv_params: bool = True  # one QKV weight per block (TE's interleaved-per-group layout)

    RANGES: ClassVar[dict[str, Rule]] = {
        "vocab_size": Int(1, INT32_MAX),
        "make_vocab_size_divisible_by": Int(1, INT32_MAX),
        "seq_length": Int(1, INT32_MAX),
        "hidden_size": Int(1, INT32_MAX),
        "num_layers": Int(1, INT32_MAX),
        "num_attention_heads": Int(1, INT32_MAX),
        "num_query_groups": Int(1, INT32_MAX),
        "ffn_hidden_size": Int(1, INT32_MAX),
        # The slowest rotating pair of dimensions turns once in about 2 pi base positions: far past any
        # seq_length at the upper bound; at 1 or below, every pair turns at least as fast as the first.
        "rotary_base": Real(1, 1e12, open_low=True),
        "norm_epsilon": Real(0, 1, open_low=True),
        "init_std": Real(0, 1),
        "hidden_dropout": Real(0, 1),
        "attention_dropout": Real(0, 1),
    }


@dataclass
class GPTDataConfig(DataConfig):
    format: TextFormat = TextFormat.text
    text_files: list[str] = field(default_factory=list)  # text: the files
    text_document: TextDocument = TextDocument.paragraph  # text, .txt files
    text_key: str = "text"  # text: .jsonl key / .parquet column
    prefixes: list[str] = field(default_factory=list)  # indexed: <prefix>.bin/.idx, one per dataset
    weights: Optional[list[float]] = None  # indexed: blending weights, one per prefix (null: by size)
    tokenizer: str = "byte"  # byte | path of a local Hugging Face tokenizer folder (the one the files were made with)
    eod_token: Optional[str] = None  # HF tokenizers: the end-of-document token (null: its eos_token)
    split: str = "949,50,1"  # train, validation, test shares of the documents
    cache_dir: str = "${repo_dir:}/outputs/data_cache"  # tokenized text and Megatron-Core's sample index caches
    eod_mask_loss: bool = False  # no loss on predicting the token after an end-of-document
    val_num_samples: Optional[int] = None  # null: the validation split once

    RANGES: ClassVar[dict[str, Rule]] = {
        # Relative: Megatron-Core divides them by their sum (checked below), so counts serve as well as shares.
        "weights": Numbers(Real(0, 1e15)),
        "val_num_samples": Int(1, INT32_MAX),
    }

    @staticmethod
    def check(c, key: str) -> None:
        require(is_valid_split(c.split),
                f"{key}.split={c.split}: expected 1 to 3 numbers >= 0 separated by commas (or slashes), not all 0: "
                "the train, validation, test shares (e.g. 949,50,1)")
        require(c.weights is None or sum(c.weights) > 0, f"{key}.weights={list(c.weights or [])}: expected a sum > 0")
        both = c.weights is not None and c.prefixes and c.format == TextFormat.indexed
        require(not both or len(c.weights) == len(c.prefixes),
                f"{key}.weights={list(c.weights or [])} and {key}.prefixes={list(c.prefixes)}: expected one weight per "
                "prefix (or weights=null: by size)")


def is_valid_split(split: str) -> bool:
    """1 to 3 numbers >= 0 separated by commas or slashes, with a sum > 0. Megatron-Core reads every run of
    digits and dots in data.split as a number, missing ones as 0, and divides them by their sum; anything
    else there would be read as other numbers, or fail, or divide by 0."""
    parts = [part.strip() for part in re.split(r"[,/]", split)]
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+\.?\d*|\.\d+", part) for part in parts):
        return False
    shares = [float(part) for part in parts]
    return all(math.isfinite(share) for share in shares) and sum(shares) > 0  # a long run of digits reads as inf
