"""Schemas of the GPT recipe's `model` and `data` config groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING

from core.config.schema import DataConfig, ModelConfig, check_ranges


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

    @staticmethod
    def check(c, key: str) -> None:
        check_ranges(c, key, positive=("vocab_size", "make_vocab_size_divisible_by", "seq_length", "hidden_size",
                                       "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                                       "rotary_base", "norm_epsilon"),
                     non_negative=("init_std",), probabilities=("hidden_dropout", "attention_dropout"))


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
