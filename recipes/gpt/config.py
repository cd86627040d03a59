"""Schemas of the GPT recipe's `model` and `data` config groups."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Optional

from omegaconf import MISSING, OmegaConf

from core.config.errors import require
from core.config.ranges import INT32_MAX, TRANSFORMER_BLOCK_RANGES, Int, Numbers, Real, Rule
from core.config.schema import DataConfig, ModelConfig
from recipes.gpt.chat import TooLong


class TextFormat(StrEnum):
    text = "text"  # raw text files (.txt / .jsonl / .parquet) tokenized on first use into cache_dir
    indexed = "indexed"  # Megatron .bin/.idx datasets (`python -m recipes.gpt.preprocess`), blended by weights
    mock = "mock"  # Megatron-Core's MockGPTDataset (synthetic, for throughput)
    chat = "chat"  # chat / instruction rows for fine-tuning (data.train_path, data.val_path): recipes/gpt/chat.py


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
        "num_query_groups": Int(1, INT32_MAX),
        **TRANSFORMER_BLOCK_RANGES,
    }

    @staticmethod
    def check(c, key: str) -> None:
        """What recipes/gpt/model.py builds from these sizes, with distributed.tp ranks."""
        heads, groups = c.num_attention_heads, c.num_query_groups or c.num_attention_heads
        require(
            c.hidden_size % heads == 0,
            f"{key}.hidden_size={c.hidden_size} and {key}.num_attention_heads={heads}: expected hidden_size "
            "divisible by num_attention_heads (each head takes hidden_size / num_attention_heads of it)",
        )
        require(
            c.hidden_size // heads % 2 == 0,
            f"{key}.hidden_size={c.hidden_size} and {key}.num_attention_heads={heads}: the head size "
            f"{c.hidden_size // heads} must be even (rotary embeddings turn pairs of its channels)",
        )
        require(
            heads % groups == 0,
            f"{key}.num_attention_heads={heads} and {key}.num_query_groups={groups}: expected num_attention_heads "
            "divisible by num_query_groups (each key/value group serves the same number of query heads)",
        )
        tp = tensor_parallel_size(c)
        for name, n in (
            ("num_attention_heads", heads),
            ("num_query_groups", groups),
            ("ffn_hidden_size", c.ffn_hidden_size),
        ):
            require(
                n % tp == 0,
                f"{key}.{name}={n} is not divisible by distributed.tp={tp}: each tensor-parallel "
                "rank holds an equal part of them",
            )


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
    # Document masks: attention never crosses a document boundary within a sample, rotary positions restart at
    # each document (recipes/gpt/packing.py). Pretraining samples are split after each end-of-document token.
    packing: bool = False
    # Documents one sample keeps apart (its cu_seqlens has this + 2 entries: static shapes); the last ones of a
    # sample holding more share one span, counted in the log. Every slot costs attention time, used or not
    # (docs/performance.md): raise it for corpora of documents much shorter than seq_length / 16.
    max_documents_per_sample: int = 16
    # Packed chat rows (format=chat, packing): each conversation's slot padded to a multiple of this; with context
    # parallelism (distributed.cp) 2 x cp unless set to a multiple of it (recipes/gpt/sft_data.py).
    pad_sequences_to_multiple_of: int = 1
    # chat: .jsonl / .parquet files of {"prompt", "response"} or {"messages"} rows (recipes/gpt/chat.py), the loss on
    # the responses only; rows longer than model.seq_length + 1 tokens (seq_length positions) are truncated or dropped.
    train_path: Optional[str] = None
    val_path: Optional[str] = None  # null: no validation
    too_long: TooLong = TooLong.truncate

    RANGES: ClassVar[dict[str, Rule]] = {
        # Relative: Megatron-Core divides them by their sum (checked below), so counts serve as well as shares.
        "weights": Numbers(Real(0, 1e15)),
        "val_num_samples": Int(1, INT32_MAX),
        "max_documents_per_sample": Int(1, 1 << 20),
        "pad_sequences_to_multiple_of": Int(1, INT32_MAX),
    }

    @staticmethod
    def check(c, key: str) -> None:
        check_chat_keys(c, key)
        require(
            is_valid_split(c.split),
            f"{key}.split={c.split}: expected 1 to 3 numbers >= 0 separated by commas (or slashes), not all 0: "
            "the train, validation, test shares (e.g. 949,50,1)",
        )
        require(c.weights is None or sum(c.weights) > 0, f"{key}.weights={list(c.weights or [])}: expected a sum > 0")
        # Megatron-Core blends one dataset per prefix and asserts one weight per dataset: format=indexed reads
        # data.prefixes, format=text makes one dataset of all its files; format=mock uses neither.
        weights = list(c.weights or [])
        if c.format == TextFormat.indexed and c.prefixes:
            require(
                c.weights is None or len(weights) == len(c.prefixes),
                f"{key}.weights={weights} and {key}.prefixes={list(c.prefixes)}: expected one weight per prefix "
                "(or weights=null: by size)",
            )
        check_max_documents(c, key)
        require(
            c.pad_sequences_to_multiple_of == 1 or (c.format == TextFormat.chat and c.packing),
            f"{key}.pad_sequences_to_multiple_of={c.pad_sequences_to_multiple_of}: only packed chat rows "
            f"({key}.format=chat {key}.packing=true) pad their conversations; give 1",
        )
        if c.format == TextFormat.text:
            require(
                c.weights is None or len(weights) == 1,
                f"{key}.weights={weights}: {key}.format=text makes one dataset of all {key}.text_files; expected "
                "one weight (or weights=null)",
            )


def check_chat_keys(c, key: str) -> None:
    """format=chat reads data.train_path (and data.val_path); the other formats read neither."""
    if c.format == TextFormat.chat:
        require(
            bool(c.train_path),
            f"{key}.format=chat needs {key}.train_path (a .jsonl or .parquet file of chat rows; {key}.val_path "
            "for validation)",
        )
    else:
        for name in ("train_path", "val_path"):
            value = getattr(c, name)
            require(
                not value,
                f"{key}.{name}={value}: only {key}.format=chat reads it ({key}.format={c.format}); give "
                f"{key}.format=chat, or leave it out",
            )


def check_max_documents(c, key: str) -> None:
    """With data.packing, no more documents per sample than it has tokens (the slots past that stay empty)."""
    root = c._get_root() if OmegaConf.is_config(c) else None
    seq = OmegaConf.select(root, "model.seq_length", default=None) if OmegaConf.is_dict(root) else None
    if not c.packing or not isinstance(seq, int) or isinstance(seq, bool):
        return
    require(
        c.max_documents_per_sample <= seq,
        f"{key}.max_documents_per_sample={c.max_documents_per_sample} with model.seq_length={seq}: a sample of "
        f"{seq} tokens holds at most {seq} documents; give at most {seq}",
    )


def tensor_parallel_size(c) -> int:
    """distributed.tp of the config that holds the node `c`; 1 for a node on its own, or for a tp that is not valid
    (its own rule names it: `distributed` is checked after `model`)."""
    root = c._get_root() if OmegaConf.is_config(c) else None
    tp = OmegaConf.select(root, "distributed.tp", default=1) if OmegaConf.is_dict(root) else 1
    return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else 1


def is_valid_split(split: str) -> bool:
    """1 to 3 numbers >= 0 separated by commas or slashes, with a sum > 0. Megatron-Core reads every run of
    digits and dots in data.split as a number, missing ones as 0, and divides them by their sum; anything
    else there would be read as other numbers, or fail, or divide by 0."""
    parts = [part.strip() for part in re.split(r"[,/]", split)]
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+\.?\d*|\.\d+", part) for part in parts):
        return False
    shares = [float(part) for part in parts]
    return all(math.isfinite(share) for share in shares) and sum(shares) > 0  # a long run of digits reads as inf
