"""The GPT recipe: decoder-only language model pretraining on Megatron-Core datasets, and supervised fine-tuning
on chat rows (data.format=chat: recipes/gpt/sft_data.py).

torchrun --nproc-per-node 2 train.py --config-name gpt_sanity          # the shipped corpus, a CPU is enough
torchrun --nproc-per-node 2 train.py --config-name gpt_sft_sanity      # the shipped chat set, a tiny Llama
torchrun --nproc-per-node 8 train.py --config-name gpt_125m data=gpt_indexed data.prefixes=[/data/corpus]
"""

from __future__ import annotations

import functools
import math
import re
from collections import OrderedDict

import torch
from torch import nn

from core.config.errors import ConfigError
from core.layers.context_parallel import packed_load_balanced_positions, padding_multiple
from core.layers.namespace import Layers
from core.layers.weight_init import init_parameters, standard_rule
from core.training.memory_plan import BlockShape
from recipes.base import Datasets, Recipe
from recipes.gpt.config import GPTDataConfig, GPTModelConfig
from recipes.gpt.data import build_gpt_datasets, document_windows, padded_vocab_size
from recipes.gpt.model import GPT
from recipes.gpt.sft_data import chat_splits
from recipes.gpt.tokenizer import build_tokenizer


class GPTRecipe(Recipe):
    name = "gpt"
    model_schema = GPTModelConfig
    data_schema = GPTDataConfig
    model_data_keys = ("tokenizer", "eod_token")  # the token ids
    predict_config = "gpt_sanity"
    tiny_configs = {
        "": (
            "gpt_sanity",
            (
                "data=gpt_mock",
                "data.cache_dir={tmp}",
                "model.vocab_size=64",
                "model.seq_length=8",
                "model.num_layers=1",
            ),
        )
    }

    @functools.cached_property
    def vocab_size(self) -> int:
        """The model's vocabulary: model.vocab_size, or the tokenizer's rounded up for fast GEMMs."""
        model_cfg, data_cfg = self.cfg.model, self.cfg.data
        if model_cfg.vocab_size is not None:
            needed = (
                None
                if data_cfg.format == "mock"
                else build_tokenizer(data_cfg.tokenizer, data_cfg.eod_token).vocab_size
            )
            if needed is not None and model_cfg.vocab_size < needed:
                raise ConfigError(
                    f"model.vocab_size={model_cfg.vocab_size} is smaller than the vocabulary of "
                    f"data.tokenizer={data_cfg.tokenizer} ({needed} tokens): its ids would have no "
                    f"embedding; give at least {needed}, or null (the tokenizer's, rounded up)"
                )
            return model_cfg.vocab_size
        if data_cfg.format == "mock":
            raise ConfigError("data.format=mock needs model.vocab_size (mock data has no tokenizer to take it from)")
        return padded_vocab_size(
            build_tokenizer(data_cfg.tokenizer, data_cfg.eod_token).vocab_size, model_cfg.make_vocab_size_divisible_by
        )

    @functools.cached_property
    def tokenizer(self):
        """The tokenizer the data was made with (data.tokenizer): text in and out of generate.py."""
        data_cfg = self.cfg.data
        if data_cfg.format == "mock":
            raise ConfigError(
                "data.format=mock has no tokenizer: give the data config the model was trained with (data.tokenizer)"
            )
        return build_tokenizer(data_cfg.tokenizer, data_cfg.eod_token)

    # generate.py's chat prompts (recipes/base.py: CHAT): data.tokenizer's chat template (recipes/gpt/chat.py).
    @functools.cached_property
    def _chat_template(self):
        from recipes.gpt import chat

        return chat.chat_template(self.cfg.data.tokenizer, self.cfg.data.eod_token)

    def chat_prompt(self, messages) -> tuple[list[dict], str, list[int]]:
        """A conversation (chat rows' messages, the last one the user's or the system's) checked, then its text and
        token ids with the template's generation prompt; ValueError saying what is wrong with it."""
        from recipes.gpt import chat

        try:
            messages = chat.prompt_messages(messages)
            template = self._chat_template
            return messages, template.prompt_text(messages), [int(i) for i in template.prompt_ids(messages)]
        except chat.Refusal as e:
            raise ValueError(str(e)) from None

    def end_of_turn_ids(self) -> list[int]:
        """The ids that end an assistant's turn in the chat template (where a chat reply stops)."""
        return [int(i) for i in self._chat_template.end_of_turn_ids()]

    # generate.py (core/generation/decoding.py) runs the model through these two.
    def new_kv_cache(self, model: nn.Module, max_length: int, dtype: torch.dtype):
        """An empty key/value cache for one sequence (TE's InferenceParams, or the twin's)."""
        return model.new_kv_cache(1, max_length, dtype)

    def next_logits(self, model: nn.Module, tokens: torch.Tensor, kv_cache) -> torch.Tensor:
        """tokens [1, n] -> logits [1, n, vocab]; with a `kv_cache`, the n tokens continue the cached ones."""
        if kv_cache is None:
            return model(tokens)
        kv_cache.pre_step(OrderedDict({0: tokens.shape[1]}))  # TE's API: the new tokens of each sequence
        return model(tokens, kv_cache=kv_cache)

    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        model_cfg = self.cfg.model
        model = GPT(model_cfg, self.vocab_size, layers, device=device)
        # Megatron's init: normal(0, init_std), the blocks' output projections scaled by 1/sqrt(2 layers).
        base = standard_rule(model_cfg.init_std)
        scaled = standard_rule(model_cfg.init_std / math.sqrt(2 * model_cfg.num_layers))

        def rule(name: str, t: torch.Tensor, g: torch.Generator) -> None:
            (scaled if name.endswith(("proj.weight", "fc2_weight")) else base)(name, t, g)

        init_parameters(model, self.cfg.seed, rule, layers.tp)
        return model

    def block_shape(self) -> BlockShape:
        m = self.cfg.model
        head_dim = m.hidden_size // m.num_attention_heads
        kv = (m.num_query_groups or m.num_attention_heads) * head_dim
        return BlockShape(m.num_layers, m.hidden_size, m.ffn_hidden_size, kv, gated=True, logits=self.vocab_size)

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.TransformerLayer]

    def _splits(self) -> dict:
        training = self.cfg.training
        if self.cfg.data.format == "chat":  # whole conversations: epochs are known, training.epochs works
            multiple = self.sequence_multiple() if self.cfg.data.packing else 1
            train, val = chat_splits(self.cfg, self.tokenizer.eod, multiple)
            return {"train": train, "val": val, "test": None}
        if training.steps is None:  # Megatron's indexed datasets are built for a number of samples
            raise ConfigError(
                "training.epochs: the GPT recipe's datasets are built for a number of samples; give training.steps"
            )
        datasets = build_gpt_datasets(
            self.cfg.data,
            self.cfg.model.seq_length,
            self.cfg.seed,
            training.steps * training.global_batch_size,
            self.vocab_size,
        )
        return dict(zip(("train", "val", "test"), datasets))

    def build_datasets(self) -> Datasets:
        splits = self._splits()
        if splits["train"] is None:
            raise ConfigError(
                f"data.split={self.cfg.data.split}: the training split is empty: more data, or a larger training share"
            )
        return Datasets(splits["train"], splits["val"])

    def default_split(self) -> str:
        """test where data.split gives it a share, else val."""
        shares = [float(share) for share in re.split(r"[,/]", str(self.cfg.data.split))]
        return "test" if len(shares) == 3 and shares[2] > 0 else "val"

    def split(self, name: str):
        """predict.py: the split's documents in windows of seq_length tokens (per-document perplexity)."""
        if name not in ("train", "val", "test"):
            raise ConfigError(f"predict.split={name}: the GPT's splits are train, val and test (data.split)")
        if self.cfg.data.format == "chat":
            raise ConfigError(
                "predict.py scores documents of data.format=text or indexed; data.format=chat's validation loss "
                "and perplexity (response tokens only) are in the training run's validation figures"
            )
        if self.cfg.data.format == "mock":
            raise ConfigError(
                "predict.py scores documents, and data.format=mock (synthetic tokens, for throughput) "
                "has none: give the text to score, e.g. data=moby_dick, or data=gpt_indexed "
                "data.prefixes=[<prefix>] data.tokenizer=<the tokenizer the model was trained with>"
            )
        return document_windows(
            self._splits()[name], name, self.cfg.model.seq_length, self.tokenizer.eod, self.cfg.data.eod_mask_loss
        )

    def predict(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Per window: its document, the summed negative log-likelihood of its predicted tokens, their number."""
        mask = batch["loss_mask"].float()
        token_loss = model(batch["tokens"], labels=batch["labels"])
        return {
            "idx": batch["idx"],
            "document": batch["document"],
            "nll": (token_loss.float() * mask).sum(dim=1),
            "tokens": mask.sum(dim=1),
        }

    def finish_predictions(self, windows, columns: dict[str, torch.Tensor]) -> dict:
        """Windows (of `windows`, what split() gave) -> one row per document, in split order: its source and
        sequence number, tokens, summed NLL, perplexity, and its opening words."""
        n = len(windows.documents)
        tokens = torch.zeros(n, dtype=torch.float64).index_add_(0, columns["document"], columns["tokens"].double())
        nll = torch.zeros(n, dtype=torch.float64).index_add_(0, columns["document"], columns["nll"].double())
        parts = windows.parts
        return {
            "document": torch.arange(n),
            "source": [parts[p][0] for p, _ in windows.documents],
            "sequence": torch.tensor([seq for _, seq in windows.documents]),
            "tokens": tokens.long(),
            "nll": nll,
            "perplexity": (nll / tokens.clamp(min=1)).exp(),
            "opening": [
                self.tokenizer.decode(windows.document_tokens(d)[:48]).replace("\n", " ").rstrip("\ufffd")
                for d in range(n)
            ],
        }

    def summarize_predictions(self, columns: dict) -> dict[str, float | int]:
        """The split's perplexity: exp(total NLL / total tokens), documents weighted by their length."""
        total = columns["tokens"].sum().item()
        return {
            "documents": len(columns["tokens"]),
            "tokens": int(total),
            "perplexity": math.exp(min(columns["nll"].sum().item() / max(total, 1), 50.0)),
        }

    def loss_count(self, batch: dict) -> torch.Tensor:
        return batch["loss_mask"].sum()

    def check_context_parallel(self, cp_size: int) -> None:
        """Rows of seq_length tokens (pretraining text, or one conversation each), each cut into 2 x cp chunks;
        packed chat rows, each conversation padded to a multiple of 2 x cp and cut so (core/layers/
        context_parallel.py)."""
        data, seq = self.cfg.data, self.cfg.model.seq_length
        if data.packing and data.format != "chat":
            raise ConfigError(
                f"distributed.cp={cp_size} with data.packing=true on data.format={data.format}: a pretraining "
                "sample's documents fill its row with no room to pad each to a multiple of 2 x cp, which context "
                "parallelism cuts them into; use data.packing=false (packed chat rows, data.format=chat, split)"
            )
        if seq % (2 * cp_size):
            raise ConfigError(
                f"model.seq_length={seq} with distributed.cp={cp_size}: each row is cut into 2 x {cp_size} equal "
                f"chunks; make the sequence length a multiple of {2 * cp_size}"
            )
        if data.packing:
            self.sequence_multiple(cp_size)

    def sequence_multiple(self, cp: int | None = None) -> int:
        """What each conversation of a packed chat row is padded to a multiple of: data.pad_sequences_to_multiple_of,
        or 2 x cp (distributed.cp unless given) where that is 1."""
        cp = int(self.cfg.distributed.cp) if cp is None else cp
        multiple = padding_multiple(int(self.cfg.data.pad_sequences_to_multiple_of), cp, "conversation")
        if self.cfg.model.seq_length % multiple:
            raise ConfigError(
                f"model.seq_length={self.cfg.model.seq_length}: conversations are padded to multiples of {multiple} "
                "(data.pad_sequences_to_multiple_of), which must divide it"
            )
        return multiple

    def context_parallel_share(self, batch: dict, cp) -> dict:
        """Every per-token tensor ([rows, seq, ...]: tokens, labels, loss_mask, position_ids) at this rank's
        positions; the model rotates them at those positions and attends over the group's. Packed rows: each
        document's share (its chunks r and 2 x cp - 1 - r), as TE's context-parallel attention takes them; the
        offsets stay whole. Per-row figures (real_tokens, documents) stay whole: `work` counts whole rows, and the
        meter shares them among the cp ranks."""
        seq = batch["tokens"].shape[1]
        per_token = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == seq]
        per_token = [k for k in per_token if k not in ("cu_seqlens", "seqlens")]  # per slot, whatever their size
        if "cu_seqlens" not in batch:
            return {**batch, **{k: cp.share(batch[k], 1) for k in per_token}}
        index = torch.stack([packed_load_balanced_positions(cu, cp.size, cp.rank) for cu in batch["cu_seqlens"]])
        return {**batch, **{k: _gather_tokens(batch[k], index) for k in per_token}}

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per sequence: the summed cross-entropy of its unmasked tokens, and their number."""
        mask = batch["loss_mask"].float()
        # data.packing: document masks from the sample's cu_seqlens (recipes/gpt/packing.py)
        token_loss = model(batch["tokens"], labels=batch["labels"], cu_seqlens=batch.get("cu_seqlens"))
        return {"loss": (token_loss * mask).sum(dim=1), "count": mask.sum(dim=1)}

    def work(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Packed rows (data.packing): the micro-batch's real tokens and their training FLOPs, 6 N per token plus,
        per document of s tokens, the attention's 12 L H s^2 (forward + backward). A row's documents are its
        first `documents` pieces where the batch gives "documents" [rows] (the pieces after them are padding), else
        all of them (a pretraining sample is documents throughout); conversations padded to a multiple
        (data.pad_sequences_to_multiple_of: "seqlens" [rows, slots]) count their positions without the padding.
        Unpacked rows of one conversation padded ("real_tokens" [rows]): those tokens, and the attention over them
        alone. Other unpacked rows: None (seq_length tokens each)."""
        cu_seqlens = batch.get("cu_seqlens")
        if cu_seqlens is None and "real_tokens" not in batch:
            return None
        if cu_seqlens is None:
            lengths = batch["real_tokens"].reshape(-1, 1).double()
        elif "seqlens" in batch:  # conversations padded to a multiple: their positions without the padding
            lengths = batch["seqlens"].double()
        else:
            lengths = cu_seqlens.diff(dim=1).double()
        if cu_seqlens is not None and "documents" in batch:
            pieces = torch.arange(lengths.shape[1], device=lengths.device)
            lengths = lengths * (pieces < batch["documents"].reshape(-1, 1).to(lengths.device))
        m = self.cfg.model
        tokens = lengths.sum()
        flops = self.flops_per_token() * tokens + 12.0 * m.num_layers * m.hidden_size * lengths.square().sum()
        return tokens, flops

    def summarize_validation(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "perplexity": math.exp(min(means["loss"], 50.0))}

    def validation_metrics(self) -> tuple[str, ...]:
        return ("loss", "perplexity")

    def tokens_per_sample(self) -> int:
        return self.cfg.model.seq_length

    def non_embedding_parameters(self) -> int:
        """All parameters but the input embedding table (the output projection counts: tied or not)."""
        model_cfg = self.cfg.model
        h, f, heads = model_cfg.hidden_size, model_cfg.ffn_hidden_size, model_cfg.num_attention_heads
        kv = (model_cfg.num_query_groups or heads) * (h // heads)
        block = h * (h + 2 * kv) + h * h + 2 * f * h + f * h + 2 * h  # QKV, proj, fc1 (gate+up), fc2, 2 norms
        return model_cfg.num_layers * block + h + self.vocab_size * h  # + final norm + output projection

    def flops_per_sample(self) -> float:
        """Training FLOPs of one sequence of S tokens: S x (6 N + 12 L H S), N = non-embedding parameters
        (the output projection included), 12 L H S the attention scores and their weighting of the values
        (forward + backward, causal masking not discounted); 6 N as finetune.mode trains (flops_per_token)."""
        model_cfg = self.cfg.model
        s = model_cfg.seq_length
        return s * (self.flops_per_token() + 12.0 * model_cfg.num_layers * model_cfg.hidden_size * s)

    def flops_per_token(self) -> float:
        """The weights' matmul FLOPs of a training token as finetune.mode trains them: 2 per parameter forward, 2 for
        the input's gradient, 2 for the weight's own. Full: 6 N. LoRA: no weight gradients for the frozen weights
        (4 N) and 6 per adapter parameter. Frozen: the forward (2 N) and the weight gradients of the weights under
        finetune.head (no input gradient is needed below them: the output projection is the GPT's only head)."""
        ft, n = self.cfg.finetune, self.non_embedding_parameters()
        mode = str(ft.mode)
        if mode == "lora":
            return 4.0 * n + 6.0 * self.adapter_parameters(list(ft.lora.target_modules), ft.lora.rank)
        if mode == "frozen":
            head = self.vocab_size * self.cfg.model.hidden_size if "output_layer" in list(ft.head) else 0
            return 2.0 * n + 2.0 * head
        return 6.0 * n

    def adapter_parameters(self, targets: list[str], rank: int) -> int:
        """LoRA parameters a token multiplies through: rank x (inputs + outputs) of each targeted Linear layer."""
        m = self.cfg.model
        h, heads = m.hidden_size, m.num_attention_heads
        kv = (m.num_query_groups or heads) * (h // heads)
        per_layer = {"layernorm_qkv": h + h + 2 * kv, "proj": 2 * h}
        total = sum(m.num_layers * per_layer[t] for t in targets if t in per_layer)
        total += h + self.vocab_size if "output_layer" in targets else 0
        return rank * total


RECIPE = GPTRecipe


def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [rows, seq, ...] at index [rows, k] along its token dimension -> [rows, k, ...]."""
    index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return x.gather(1, index)
