"""Schemas of the ESM-2 recipe's `model` and `data` config groups."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Optional

from omegaconf import MISSING

from core.config.errors import require
from core.config.ranges import INT32_MAX, TRANSFORMER_BLOCK_RANGES, Int, Real, Rule
from core.config.schema import DataConfig, ModelConfig


class Activation(StrEnum):
    gelu = "gelu"  # TE's GELU (the tanh form), fused into its MLP kernels
    gelu_erf = "gelu_erf"  # the exact GELU of ESM-2 and Hugging Face (the plain-torch layers only)


@dataclass
class ESM2ModelConfig(ModelConfig):
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_attention_heads: int = MISSING
    ffn_hidden_size: int = MISSING
    max_seq_length: int = 1024  # tokens of one sequence with <cls> and <eos>; longer ones are cropped at random
    activation: Activation = Activation.gelu
    token_dropout: bool = True  # ESM-2's rescaling of the embeddings by each sequence's share of <mask> tokens
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    fuse_qkv_params: bool = True  # one QKV weight per block (TE's per-head interleaved layout)

    RANGES: ClassVar[dict[str, Rule]] = {
        **TRANSFORMER_BLOCK_RANGES,
        "max_seq_length": Int(3, INT32_MAX, note="<cls>, a residue, <eos>"),
    }

    @staticmethod
    def check(c, key: str) -> None:
        heads = c.num_attention_heads
        require(
            c.hidden_size % heads == 0 and c.hidden_size // heads % 2 == 0,
            f"{key}.hidden_size={c.hidden_size} and {key}.num_attention_heads={heads}: expected an even head size "
            "(hidden_size / num_attention_heads; rotary embeddings turn pairs of its channels)",
        )


@dataclass
class ESM2DataConfig(DataConfig):
    # A FASTA / parquet / CSV / TSV file, a folder of them, a `datasets` save_to_disk folder, or a folder written
    # by `python -m recipes.esm2.preprocess` (memory-mapped: for large datasets).
    path: str = MISSING
    column: str = "sequence"  # parquet / CSV / datasets: the column of sequences
    name_column: Optional[str] = "id"  # ... and of their names (predict.py's output); missing: row numbers
    split: str = "train"  # a `datasets` DatasetDict folder: the split to read
    val_path: Optional[str] = None  # validation sequences from their own files; null: val_fraction of path's
    val_fraction: float = 0.02  # with val_path null: the share of sequences held out (drawn with split_seed)
    split_seed: int = 42
    # Packed: rows of tokens_per_pack tokens holding as many whole (cropped) sequences as fit, at most
    # max_sequences_per_pack; padded: one sequence per row of model.max_seq_length tokens.
    packing: bool = True
    tokens_per_pack: int = 8192
    max_sequences_per_pack: int = 64
    # Each sequence padded to a multiple of this many tokens (padding no real token attends to). Context parallelism
    # needs multiples of 2 x distributed.cp (1: that, or no padding without it).
    pad_sequences_to_multiple_of: int = 1
    mask_fraction: float = 0.15  # residues selected for prediction; of those:
    mask_replace: float = 0.8  # shown as <mask>
    random_replace: float = 0.1  # shown as a random amino acid (the rest unchanged)
    num_workers: int = 2

    RANGES: ClassVar[dict[str, Rule]] = {
        "val_fraction": Real(0, 1, open_low=True, open_high=True),
        "split_seed": Int(0, INT32_MAX),
        "tokens_per_pack": Int(3, INT32_MAX),
        "max_sequences_per_pack": Int(1, INT32_MAX),
        "pad_sequences_to_multiple_of": Int(1, INT32_MAX),
        "mask_fraction": Real(0, 1, open_low=True),
        "mask_replace": Real(0, 1),
        "random_replace": Real(0, 1),
    }

    @staticmethod
    def check(c, key: str) -> None:
        require(
            c.mask_replace + c.random_replace <= 1,
            f"{key}.mask_replace={c.mask_replace} + {key}.random_replace={c.random_replace}: expected a sum <= 1 "
            "(shares of the selected residues)",
        )
