"""Chat rows for supervised fine-tuning (data.format=chat): conversations -> the GPT recipe's samples.

Each split's file (data.train_path, data.val_path) is read once by recipes/gpt/chat.py (`read_chat`: rendered with
data.tokenizer's chat template or the plain template, a response-only mask, rows longer than model.seq_length + 1
tokens (model.seq_length positions) truncated or dropped by data.too_long; its summary line logged once, by rank 0).

A conversation of n tokens gives n - 1 positions: inputs ids[:-1], labels ids[1:], loss_mask = its mask[1:] (a
position is scored when the token it predicts is the response's), so labels never cross into another conversation.

With data.packing, conversations share rows of model.seq_length tokens: planned once per split (a seeded shuffle of
the training split, the validation split in file order; then each row filled until the next conversation does not
fit, or it holds data.max_documents_per_sample: core/data/pack_planning.py), and each row carries "cu_seqlens"
(recipes/gpt/packing.py:row_offsets) so attention and rotary positions stay within a conversation. With `multiple` > 1
(data.pad_sequences_to_multiple_of; 2 x distributed.cp for context parallelism, which cuts every conversation into
2 x cp equal chunks) each conversation's slot is padded to a multiple of it: the padding follows the conversation's
tokens, so under the causal mask none of them sees it. Without packing each row is one conversation padded to
model.seq_length. Padding positions: the end-of-document id as input, label 0, no
loss. Rows are the same on every call and rank: the loop's sampler shuffles and shares them out.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from core.config.errors import ConfigError
from core.data.datasets import epoch_index, mix_seed
from core.data.pack_planning import plan_packs
from recipes.gpt.chat import ChatTokens, chat_template, read_chat
from recipes.gpt.packing import row_offsets

log = logging.getLogger(__name__)


class ChatRows(Dataset):
    """Rows of `chats`' conversations: {"tokens", "labels" (int64), "loss_mask" (float32): [seq_length], "idx"}, and
    when packed (`max_documents` not None) "cu_seqlens" [max_documents + 2] (int32; each conversation's slot padded
    to a multiple of `multiple`) and "documents" (how many conversations the row holds), with `multiple` > 1 also
    "seqlens" [max_documents + 1] (int32: each slot's positions without its padding), else "real_tokens" (the
    conversation's positions before the padding)."""

    def __init__(
        self,
        chats: ChatTokens,
        seq_length: int,
        pad: int,
        max_documents: Optional[int],
        shuffle_seed: Optional[int],
        multiple: int = 1,
    ):
        self.chats, self.seq_length, self.pad, self.max_documents = chats, seq_length, pad, max_documents
        if multiple < 1 or (multiple > 1 and max_documents is None):
            raise ValueError(f"multiple={multiple}: unpacked rows (max_documents=None) take 1; packed rows any >= 1")
        self.multiple = multiple
        positions = np.maximum(np.diff(chats.offsets) - 1, 0)
        if len(positions) and positions.max() > seq_length:
            raise ValueError(f"{chats.source}: a conversation of {positions.max() + 1} tokens, rows of {seq_length}")
        self.slots = -(-positions // multiple) * multiple  # each conversation's positions and its padding
        if len(positions) and self.slots.max() > seq_length:
            raise ValueError(f"rows of {seq_length} tokens do not hold conversations padded to multiples of {multiple}")
        if max_documents is None:
            self.order, self.starts = np.arange(len(chats)), np.arange(len(chats) + 1)
        else:
            order = np.arange(len(chats))
            if shuffle_seed is not None:
                np.random.default_rng(shuffle_seed).shuffle(order)
            self.order, self.starts = order, plan_packs(self.slots[order], seq_length, max_documents)
        self.real_tokens = int(positions.sum())  # positions that are not padding, over every row

    def __len__(self) -> int:
        return len(self.starts) - 1

    def conversations(self, k: int) -> list[int]:
        """Which conversations (their order in the file's kept rows) row k holds."""
        return self.order[self.starts[k] : self.starts[k + 1]].tolist()

    def __getitem__(self, index) -> dict:
        k = epoch_index(index).idx
        if not 0 <= k < len(self):
            raise IndexError(f"row {k} of {len(self)}")
        tokens = torch.full((self.seq_length,), self.pad, dtype=torch.int64)
        labels = torch.zeros(self.seq_length, dtype=torch.int64)
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        lengths, real = [], []  # per conversation: its slot (positions, then padding to the multiple), its positions
        for i in self.conversations(k):
            ids, mask = self.chats.row(i)
            start, n = sum(lengths), max(len(ids) - 1, 0)
            tokens[start : start + n] = torch.from_numpy(ids[:-1].astype(np.int64))
            labels[start : start + n] = torch.from_numpy(ids[1:].astype(np.int64))
            loss_mask[start : start + n] = torch.from_numpy(mask[1:].astype(np.float32))
            lengths.append(int(self.slots[i]))
            real.append(n)
        row = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "idx": k}
        if self.max_documents is not None:
            row["cu_seqlens"] = torch.from_numpy(row_offsets(lengths, self.seq_length, self.max_documents + 1))
            row["documents"] = len(lengths)  # the pieces before the padding's: Recipe.work counts their tokens
            if self.multiple > 1:  # each slot's positions without its padding: what Recipe.work counts then
                row["seqlens"] = torch.zeros(self.max_documents + 1, dtype=torch.int32)
                row["seqlens"][: len(real)] = torch.tensor(real, dtype=torch.int32)
        else:
            row["real_tokens"] = lengths[0]  # the positions before the padding: Recipe.work counts them
        return row


def chat_splits(cfg, tokenizer_eod: int, multiple: int = 1) -> tuple[ChatRows, Optional[ChatRows]]:
    """(training rows, validation rows or None) of data.train_path and data.val_path for the config `cfg`; packed
    rows pad each conversation's slot to a multiple of `multiple`."""
    data, seq_length = cfg.data, cfg.model.seq_length
    if not data.train_path:
        raise ConfigError("data.format=chat needs data.train_path (a .jsonl or .parquet file of chat rows)")
    renderer = chat_template(data.tokenizer, data.eod_token)
    max_documents = data.max_documents_per_sample if data.packing else None
    splits = []
    for setting, path, seed in (
        ("data.train_path", data.train_path, mix_seed(cfg.seed, 0xC4A7)),
        ("data.val_path", data.val_path, None),
    ):
        if not path:
            splits.append(None)
            continue
        # n tokens make n - 1 positions: a row of seq_length positions holds a conversation of seq_length + 1
        chats, summary = read_chat(path, setting, renderer, seq_length + 1, data.too_long)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("%s", summary.line())
        if len(chats) == 0:
            raise ConfigError(
                f"{summary.line()}: nothing to train on; a larger model.seq_length, or data.too_long=truncate"
            )
        splits.append(ChatRows(chats, seq_length, tokenizer_eod, max_documents, seed, multiple))
    return splits[0], splits[1]
