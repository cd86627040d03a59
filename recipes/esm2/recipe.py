"""The ESM-2 recipe: protein masked-language-model pretraining (or fine-tuning) on packed sequences.

    torchrun --nproc-per-node 2 train.py --config-name esm2_sanity        # the shipped UniRef90 slice, on CPUs
    torchrun --nproc-per-node 8 train.py --config-name esm2_650m data.path=/data/uniref90_store
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from core.config.errors import ConfigError
from core.data.datasets import mix_seed
from core.layers.namespace import Layers
from core.layers.weight_init import init_parameters, standard_rule
from recipes.base import Datasets, Recipe
from recipes.esm2.config import ESM2DataConfig, ESM2ModelConfig
from recipes.esm2.masking import Masking
from recipes.esm2.model import ESM2, VOCAB_SIZE
from recipes.esm2.packing import PackedSequences
from recipes.esm2.sequences import SequenceStore, read_store
from recipes.esm2.tokenizer import MASK


class ESM2Recipe(Recipe):
    name = "esm2"
    model_schema = ESM2ModelConfig
    data_schema = ESM2DataConfig

    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        model = ESM2(self.cfg.model, layers, device=device)
        init_parameters(model, self.cfg.seed, standard_rule(self.cfg.model.init_std), layers.tp)
        return model

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.TransformerLayer]

    # --- data --------------------------------------------------------------------------------
    def pack_shape(self) -> tuple[int, int]:
        """(tokens per row, sequences per row at most): packed rows, or one padded sequence per row."""
        data, max_length = self.cfg.data, self.cfg.model.max_seq_length
        if not data.packing:
            return max_length, 1
        if data.tokens_per_pack < max_length:
            raise ConfigError(f"data.tokens_per_pack={data.tokens_per_pack} is smaller than model.max_seq_length="
                              f"{max_length}: a pack must hold the longest (cropped) sequence")
        return data.tokens_per_pack, data.max_sequences_per_pack

    def _packs(self, store: SequenceStore, indices: np.ndarray, shuffle_seed: int | None) -> PackedSequences:
        data = self.cfg.data
        budget, max_sequences = self.pack_shape()
        masking = Masking(data.mask_fraction, data.mask_replace, data.random_replace)
        return PackedSequences(store, indices, budget, self.cfg.model.max_seq_length, max_sequences, masking,
                               self.cfg.seed, shuffle_seed)

    def build_datasets(self) -> Datasets:
        """Packs of the training sequences (which share a pack: planned once, from the seed) and of the validation
        sequences (in order): data.val_path's, or data.val_fraction of data.path's drawn with data.split_seed."""
        data = self.cfg.data
        store = read_store(data.path, data.column, data.name_column, data.split)
        if data.val_path is not None:
            train_indices = np.arange(len(store))
            val_store = read_store(data.val_path, data.column, data.name_column, data.split)
            val_indices = np.arange(len(val_store))
        else:
            held_out = max(1, round(len(store) * data.val_fraction))
            if held_out >= len(store):
                raise ConfigError(f"data.val_fraction={data.val_fraction} of {len(store)} sequences leaves none to "
                                  f"train on ({data.path})")
            order = np.random.default_rng(data.split_seed).permutation(len(store))
            val_store, val_indices, train_indices = store, np.sort(order[:held_out]), np.sort(order[held_out:])
        train = self._packs(store, train_indices, shuffle_seed=mix_seed(self.cfg.seed, 0x9ac))
        return Datasets(train, self._packs(val_store, val_indices, shuffle_seed=None))

    # --- task --------------------------------------------------------------------------------
    def loss_count(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] >= 0).sum()

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per row: the summed cross-entropy of its selected residues, and their number; in validation also
        those of the residues shown as <mask> alone (the others are shown as themselves or as a random residue,
        which a model can learn to copy: they make the loss lower than what it knows of proteins)."""
        token_loss = model(batch["tokens"], batch["cu_seqlens"], labels=batch["labels"])
        out = {"loss": token_loss.sum(dim=1), "count": (batch["labels"] >= 0).sum(dim=1).to(token_loss.dtype)}
        if not training:
            shown_masked = (batch["tokens"] == MASK) & (batch["labels"] >= 0)
            out |= {"masked_loss": (token_loss * shown_masked).sum(dim=1),
                    "masked_count": shown_masked.sum(dim=1).to(token_loss.dtype)}
        return out

    def summarize_validation(self, means: dict[str, float]) -> dict[str, float]:
        """Perplexity over the selected residues (as Hugging Face's and bionemo's loss), and over those shown as
        <mask> (masked_perplexity: a residue-frequency model scores exp(entropy of the residues) there)."""
        masked = means.pop("masked_loss") / max(means.pop("masked_count"), 1e-12)
        return {**means, "perplexity": math.exp(min(means["loss"], 50.0)), "masked_perplexity": math.exp(min(masked, 50.0))}

    def validation_metrics(self) -> tuple[str, ...]:
        return ("loss", "perplexity", "masked_perplexity")

    # --- accounting --------------------------------------------------------------------------
    def tokens_per_sample(self) -> int:
        """Tokens of one row, padding included."""
        return self.pack_shape()[0]

    def non_embedding_parameters(self) -> int:
        """Parameters a token's forward multiplies through: the blocks, the LM head and the tied vocabulary matrix."""
        m = self.cfg.model
        h, f = m.hidden_size, m.ffn_hidden_size
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # QKV + proj (with biases), fc1 + fc2, two LayerNorms
        return m.num_layers * block + 2 * h + (h * h + h + 2 * h) + VOCAB_SIZE * h + VOCAB_SIZE  # padding rows not

    def flops_per_sample(self) -> float:
        """Training FLOPs of one full row of sequences of model.max_seq_length tokens: 6 N per token plus the
        attention's 12 L H s per token (forward + backward)."""
        m = self.cfg.model
        tokens, s = self.tokens_per_sample(), m.max_seq_length
        return tokens * (6.0 * self.non_embedding_parameters() + 12.0 * m.num_layers * m.hidden_size * s)


RECIPE = ESM2Recipe
