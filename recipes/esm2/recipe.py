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
from core.layers.context_parallel import packed_load_balanced_positions, padding_multiple
from core.layers.namespace import Layers
from core.layers.torch_twins import packed_positions
from core.layers.weight_init import init_parameters, standard_rule
from core.training.memory_plan import BlockShape
from recipes.base import Datasets, Recipe
from recipes.esm2.config import ESM2DataConfig, ESM2ModelConfig
from recipes.esm2.masking import Masking
from recipes.esm2.model import ESM2, VOCAB_SIZE, flat_offsets
from recipes.esm2.packing import PackedSequences
from recipes.esm2.sequences import SequenceStore, read_store
from recipes.esm2.sources import SourceKeys
from recipes.esm2.tokenizer import CLS, EOS, MASK, PAD


class ESM2Recipe(Recipe):
    name = "esm2"
    model_schema = ESM2ModelConfig
    data_schema = ESM2DataConfig
    predict_config = "esm2_sanity"
    tiny_configs = {
        "": (
            "esm2_sanity",
            (
                "model.num_layers=1",
                "model.hidden_size=32",
                "model.num_attention_heads=2",
                "model.ffn_hidden_size=64",
                "model.max_seq_length=64",
                "data.tokens_per_pack=256",
            ),
        )
    }

    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        precision = self.cfg.precision
        if layers.name == "te" and (precision.autocast_dtype or precision.param_dtype) == "fp32":
            if self.sequence_multiple() > 1:  # (TE's fused attention, the one that takes padded offsets, is 16-bit)
                raise ConfigError(
                    "sequences padded to a multiple (data.pad_sequences_to_multiple_of, or distributed.cp > 1) need "
                    "16-bit attention on TransformerEngine layers: set precision.autocast_dtype=bf16 (or "
                    "precision=bf16)"
                )
        model = ESM2(self.cfg.model, layers, device=device)
        init_parameters(model, self.cfg.seed, standard_rule(self.cfg.model.init_std), layers.tp)
        return model

    def block_shape(self) -> BlockShape:
        m = self.cfg.model
        return BlockShape(m.num_layers, m.hidden_size, m.ffn_hidden_size, m.hidden_size, False, VOCAB_SIZE)

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.TransformerLayer]

    # --- data --------------------------------------------------------------------------------
    def pack_shape(self) -> tuple[int, int]:
        """(tokens per row, sequences per row at most): packed rows, or one padded sequence per row."""
        data, max_length = self.cfg.data, self.cfg.model.max_seq_length
        row, key = (
            (data.tokens_per_pack, "data.tokens_per_pack") if data.packing else (max_length, "model.max_seq_length")
        )
        cp = int(self.cfg.distributed.cp)
        if self.cfg.precision.fp8.enabled and row % (16 * cp):
            # TE's FP8 GEMMs take token counts that are multiples of 16; a row (a rank's share of one, with context
            # parallelism) that is one keeps every batch so.
            share = f" (each of distributed.cp={cp} ranks holds {row / cp:g} of them)" if cp > 1 else ""
            raise ConfigError(
                f"{key}={row} with precision.fp8.enabled=true: FP8 needs rows of a multiple of 16 "
                f"tokens{share} (e.g. {key}={-(-row // (16 * cp)) * 16 * cp})"
            )
        if not data.packing:
            return max_length, 1
        if data.tokens_per_pack < max_length:
            raise ConfigError(
                f"data.tokens_per_pack={data.tokens_per_pack} is smaller than model.max_seq_length="
                f"{max_length}: a pack must hold the longest (cropped) sequence"
            )
        return data.tokens_per_pack, data.max_sequences_per_pack

    def sequence_multiple(self, cp: int | None = None) -> int:
        """What each sequence is padded to a multiple of: data.pad_sequences_to_multiple_of, or 2 x cp
        (distributed.cp unless given) where that is 1 (context parallelism cuts every sequence into 2 x cp equal
        chunks)."""
        cp = int(self.cfg.distributed.cp) if cp is None else cp
        multiple = padding_multiple(int(self.cfg.data.pad_sequences_to_multiple_of), cp)
        row, key = self.pack_shape()[0], "data.tokens_per_pack" if self.cfg.data.packing else "model.max_seq_length"
        for size, name in ((row, key), (self.cfg.model.max_seq_length, "model.max_seq_length")):
            if size % multiple:
                raise ConfigError(
                    f"{name}={size}: sequences are padded to multiples of {multiple} (data.pad_sequences_to_multiple_of"
                    f"{f', distributed.cp={cp}' if cp > 1 else ''}), which must divide it"
                )
        return multiple

    def _packs(self, store: SequenceStore, indices: np.ndarray, shuffle_seed: int | None) -> PackedSequences:
        """Training and validation packs, each sequence padded to sequence_multiple()."""
        data = self.cfg.data
        masking = Masking(data.mask_fraction, data.mask_replace, data.random_replace)
        return self._packed(store, indices, masking, shuffle_seed, self.sequence_multiple())

    def _packed(self, store, indices, masking: Masking, shuffle_seed: int | None, multiple: int) -> PackedSequences:
        budget, max_sequences = self.pack_shape()
        max_length, seed = self.cfg.model.max_seq_length, self.cfg.seed
        return PackedSequences(store, indices, budget, max_length, max_sequences, masking, seed, shuffle_seed, multiple)

    def build_datasets(self) -> Datasets:
        """Packs of the training sequences (which share a pack: planned once, from the seed) and of the validation
        sequences (in order): data.val_path's, or data.val_fraction of data.path's drawn with data.split_seed."""
        data = self.cfg.data
        store = self._read("data.path", data.path)
        train_indices, val_indices = self._split_indices(store)
        val_store = store
        if data.val_path is not None:
            val_store = self._read("data.val_path", data.val_path)
            val_indices = np.arange(len(val_store))
        train = self._packs(store, train_indices, shuffle_seed=mix_seed(self.cfg.seed, 0x9AC))
        return Datasets(train, self._packs(val_store, val_indices, shuffle_seed=None))

    def _read(self, setting: str, path: str) -> SequenceStore:
        """The sequences at `path`, which `setting` gave (data.path, data.val_path, predict.folder): its errors
        name that setting."""
        data = self.cfg.data
        return read_store(path, data.column, data.name_column, data.split, SourceKeys(path=setting))

    def _split_indices(self, store: SequenceStore) -> tuple[np.ndarray, np.ndarray]:
        """(training, validation) sequence indices of data.path's store, as build_datasets draws them."""
        data = self.cfg.data
        if data.val_path is not None:
            return np.arange(len(store)), np.arange(0)
        held_out = max(1, round(len(store) * data.val_fraction))
        if held_out >= len(store):
            raise ConfigError(
                f"data.val_fraction={data.val_fraction} of {len(store)} sequences leaves none to train on ({data.path})"
            )
        order = np.random.default_rng(data.split_seed).permutation(len(store))
        return np.sort(order[held_out:]), np.sort(order[:held_out])

    def _prediction_packs(self, store: SequenceStore, indices: np.ndarray) -> PackedSequences:
        """In order; 15% of each sequence's residues (seeded) shown as <mask> for its masked perplexity."""
        masking = Masking(self.cfg.data.mask_fraction, replace_with_mask=1.0, replace_with_random=0.0)
        return self._packed(store, indices, masking, shuffle_seed=None, multiple=1)

    def default_split(self) -> str:
        return "val"  # its splits are train, val and all: no test

    def split(self, name: str) -> PackedSequences:
        """predict.py: the sequences of data.path's train or val split (val: data.val_path's when given), or all."""
        data = self.cfg.data
        if name not in ("train", "val", "all"):
            raise ConfigError(f"predict.split={name}: the ESM-2 recipe's splits are train, val and all (data.path)")
        if name == "val" and data.val_path is not None:
            store = self._read("data.val_path", data.val_path)
            return self._prediction_packs(store, np.arange(len(store)))
        store = self._read("data.path", data.path)
        train, val = self._split_indices(store)
        return self._prediction_packs(store, {"train": train, "val": val, "all": np.arange(len(store))}[name])

    def unlabeled(self, folder: str) -> PackedSequences:
        """predict.folder: every sequence of a file or folder (any format data.path takes)."""
        store = self._read("predict.folder", folder)
        return self._prediction_packs(store, np.arange(len(store)))

    def predict(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Per pack, per sequence slot: the summed cross-entropy of its masked residues and their number, and the
        mean hidden state over its residues (<cls>/<eos> left out) of the input without masks."""
        tokens, labels, cu, sequences = batch["tokens"], batch["labels"], batch["cu_seqlens"], batch["sequences"]
        rows, budget = tokens.shape
        slots, kept = cu.shape[1] - 1, sequences.shape[1]
        segment, _ = packed_positions(flat_offsets(cu, budget), rows * budget)  # row r's slot j: r x slots + j

        def per_slot(values: torch.Tensor) -> torch.Tensor:
            sums = values.new_zeros(rows * slots + 1, *values.shape[1:]).index_add_(0, segment, values)
            return sums[:-1].view(rows, slots, *values.shape[1:])[:, :kept]

        nll = model(tokens, cu, labels=labels).reshape(-1).float()
        clean = torch.where(labels >= 0, labels, tokens)  # the masked residues put back
        hidden = model(clean, cu, hidden_layer=self.embedding_layer()).reshape(rows * budget, -1).float()
        residue = ~torch.isin(clean, torch.tensor([CLS, EOS, PAD], device=clean.device)).reshape(-1, 1)
        count = per_slot(residue.float())
        return {
            "sequences": sequences,
            "nll": per_slot(nll),
            "masked": per_slot((labels.reshape(-1) >= 0).float()),
            "residues": count[..., 0],
            "embedding": per_slot(hidden * residue) / count.clamp(min=1),
        }

    def embedding_layer(self) -> int:
        layer, layers = self.cfg.predict.embedding_layer, self.cfg.model.num_layers
        if layer is not None and layer > layers:
            raise ConfigError(f"predict.embedding_layer={layer}: the model has {layers} blocks (0 to {layers})")
        return layers if layer is None else layer

    def finish_predictions(self, packs: PackedSequences, columns: dict[str, torch.Tensor]) -> dict:
        """Pack slots -> one row per sequence, in the order of the split: its index in data.path's sequences, name,
        residues (after cropping), masked residues, masked perplexity (exp of their mean cross-entropy), and its
        embedding."""
        present = columns["sequences"] >= 0
        index = columns["sequences"][present]
        order = torch.argsort(index)
        pick = {k: v[present][order] for k, v in columns.items() if k != "sequences"}
        return {
            "sequence": index[order],
            "name": [packs.store.name(i) for i in index[order].tolist()],
            "residues": pick["residues"].long(),
            "masked_residues": pick["masked"].long(),
            "masked_perplexity": (pick["nll"] / pick["masked"]).exp(),
            "embedding": pick["embedding"],
        }

    def summarize_predictions(self, columns: dict) -> dict[str, float | int]:
        masked = columns["masked_residues"].sum().item()
        nll = (columns["masked_perplexity"].log() * columns["masked_residues"]).nansum().item()
        return {
            "sequences": len(columns["sequence"]),
            "masked_residues": int(masked),
            "masked_perplexity": math.exp(min(nll / max(masked, 1), 50.0)),
        }

    # --- task --------------------------------------------------------------------------------
    def loss_count(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] >= 0).sum()

    def check_context_parallel(self, cp_size: int) -> None:
        """Packs whose sequences are padded to multiples of 2 x cp (sequence_multiple says what does not divide)."""
        self.sequence_multiple(cp_size)

    def context_parallel_share(self, batch: dict, cp) -> dict:
        """This rank's tokens and labels of every sequence of each pack (chunks r and 2 x cp - 1 - r of each, as TE's
        context-parallel attention takes them); the packs' offsets, real lengths and sequences stay whole."""
        rows = [packed_load_balanced_positions(cu, cp.size, cp.rank) for cu in batch["cu_seqlens"]]
        index = torch.stack(rows)
        return {**batch, "tokens": batch["tokens"].gather(1, index), "labels": batch["labels"].gather(1, index)}

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per row: the summed cross-entropy of its selected residues, and their number; in validation also
        those of the residues shown as <mask> alone (the others are shown as themselves or as a random residue,
        which a model can learn to copy: they make the loss lower than what it knows of proteins)."""
        token_loss = model(batch["tokens"], batch["cu_seqlens"], labels=batch["labels"], seqlens=batch.get("seqlens"))
        out = {"loss": token_loss.sum(dim=1), "count": (batch["labels"] >= 0).sum(dim=1).to(token_loss.dtype)}
        if not training:
            shown_masked = (batch["tokens"] == MASK) & (batch["labels"] >= 0)
            out |= {
                "masked_loss": (token_loss * shown_masked).sum(dim=1),
                "masked_count": shown_masked.sum(dim=1).to(token_loss.dtype),
            }
        return out

    def summarize_validation(self, means: dict[str, float]) -> dict[str, float]:
        """Perplexity over the selected residues (as Hugging Face's and bionemo's loss), and over those shown as
        <mask> (masked_perplexity: a residue-frequency model scores exp(entropy of the residues) there)."""
        masked = means.pop("masked_loss") / max(means.pop("masked_count"), 1e-12)
        return {
            **means,
            "perplexity": math.exp(min(means["loss"], 50.0)),
            "masked_perplexity": math.exp(min(masked, 50.0)),
        }

    def validation_metrics(self) -> tuple[str, ...]:
        return ("loss", "perplexity", "masked_perplexity")

    # --- accounting --------------------------------------------------------------------------
    def tokens_per_sample(self) -> int:
        """Tokens of one row, padding included (the logged tokens/s and MFU count real tokens: `work`)."""
        return self.pack_shape()[0]

    def work(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's real tokens (not padding) and their training FLOPs: 6 N per token plus, per sequence
        of s tokens, the attention's 12 L H s^2 (forward + backward)."""
        m = self.cfg.model
        sequences = batch["sequences"]
        # the slots' real tokens: their lengths, or where sequences are padded (data.pad_sequences_to_multiple_of)
        lengths = batch["seqlens"] if "seqlens" in batch else batch["cu_seqlens"].diff(dim=1)
        lengths = lengths[:, : sequences.shape[1]].double() * (sequences >= 0)
        tokens = lengths.sum()
        flops = (
            6.0 * self.non_embedding_parameters() * tokens
            + 12.0 * m.num_layers * m.hidden_size * lengths.square().sum()
        )
        return tokens, flops

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
