"""Autoregressive decoding for generate.py: one prompt at a time, token by token, greedy or sampled.

With a KV cache (the default) the prompt runs once and every later step feeds only the newest token; the
model keeps the keys and values of the earlier positions (for the GPT: TE's InferenceParams on GPUs, the
twin's on other devices). Without it each step runs the whole sequence again: slower, and the reference the
cache is tested against (greedy output must be the same token for token). The model is run through the
recipe's generation protocol (recipes/base.py: GENERATION), the `Decoder` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol

import torch
from torch import nn

from core.data.datasets import mix_seed
from core.training.nonfinite import NonFiniteError


class Decoder(Protocol):
    """What decoding needs of a recipe (recipes/base.py: GENERATION) to run its model on token ids."""

    def new_kv_cache(self, model: nn.Module, max_length: int, dtype: torch.dtype) -> Any:
        """An empty key/value cache for one sequence of up to `max_length` tokens."""

    def next_logits(self, model: nn.Module, tokens: torch.Tensor, kv_cache: Any) -> torch.Tensor:
        """tokens [1, n] -> logits [1, n, vocab]; with a `kv_cache`, the tokens continue the cached ones."""


@dataclass(frozen=True)
class Sampling:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1: no limit

    def choose(self, logits: torch.Tensor, generator: Optional[torch.Generator]) -> int:
        """The next token from the last position's logits [vocab] (float32, on the CPU)."""
        if self.greedy:
            return int(logits.argmax())
        logits = logits.double() / self.temperature  # in float64: a large float32 logit / 0.001 stays finite
        if 0 < self.top_k < logits.numel():
            kth = logits.topk(self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.double().softmax(-1)
        if self.top_p < 1.0:
            # Keep the most likely tokens until their probabilities add up to top_p (at least one).
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # probability mass ahead of each token
            sorted_probs[before >= self.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))


def sample_generator(seed: int, prompt_index: int, sample_index: int) -> torch.Generator:
    """Sample j of prompt i draws from (seed, i, j) alone: a prompt's samples do not depend on the others."""
    return torch.Generator().manual_seed(mix_seed(seed, prompt_index, sample_index))


@dataclass
class Continuation:
    tokens: list[int]  # the new tokens (the stop token included when one ended the text)
    stop: str  # the stop token's reason ("eod", "end_of_turn"), or "length"

    @property
    def text_tokens(self) -> list[int]:
        """The tokens of the text: the stop token left out."""
        return self.tokens if self.stop == "length" else self.tokens[:-1]


@torch.no_grad()
def continue_prompt(
    decoder: Decoder,
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    context: int,
    sampling: Sampling,
    generator: Optional[torch.Generator],
    banned: list[int],
    stops: Mapping[int, str],
    device: torch.device,
    autocast: Callable[[], ContextManager],
    kv_cache_dtype: Optional[torch.dtype],
    on_token: Optional[Callable[[int], None]] = None,
) -> Continuation:
    """Up to `max_new_tokens` tokens after `prompt`, `model` run by `decoder` (the recipe); stop early at a token of
    `stops` ({id: the reason the Continuation gives}). `banned` token ids (the vocabulary's padding rows, the
    tokenizer's padding id) are never chosen. `kv_cache_dtype`: the dtype of the cached keys and values (that of the
    attention inputs), or None for no cache. `on_token`: called with each new token of the text as it is chosen.

    The model sees at most `context` tokens (its training sequence length): when the text outgrows that,
    the window restarts on its last context // 2 tokens (with a cache: a new cache, filled with them).
    NonFiniteError when the model's logits hold a NaN or an infinity."""
    if not prompt:
        raise ValueError("an empty prompt: give at least one token")
    text, start = list(prompt), 0  # the window is text[start:]
    cache, cached = None, 0  # tokens of the window already in the cache
    for _ in range(max_new_tokens):
        if len(text) - start > context:
            start, cache = len(text) - context // 2, None
        with autocast():
            if kv_cache_dtype is None:
                logits = decoder.next_logits(model, torch.tensor([text[start:]], device=device), None)
            else:
                if cache is None:
                    cache, cached = decoder.new_kv_cache(model, context, kv_cache_dtype), 0
                new = text[start + cached :]
                logits = decoder.next_logits(model, torch.tensor([new], device=device), cache)
                cached += len(new)
        last = logits[0, -1].float().cpu()
        if not bool(torch.isfinite(last).all()):  # else sampling fails on them, or argmax picks a NaN's token
            kind = "NaN" if bool(last.isnan().any()) else "infinite values"
            raise NonFiniteError(f"the model's logits for new token {len(text) - len(prompt) + 1} hold {kind}")
        if banned:
            last[banned] = float("-inf")
        token = sampling.choose(last, generator)
        text.append(token)
        if token in stops:
            return Continuation(text[len(prompt) :], stops[token])
        if on_token is not None:
            on_token(token)
    return Continuation(text[len(prompt) :], "length")


def banned_tokens(vocab_size: int, tokenizer) -> list[int]:
    """Ids the model has rows for but the tokenizer never produces: the padded vocabulary's extra rows
    and the tokenizer's padding id."""
    banned = set(range(tokenizer.vocab_size, vocab_size))
    if getattr(tokenizer, "pad", None) is not None and tokenizer.pad < vocab_size and tokenizer.pad != tokenizer.eod:
        banned.add(tokenizer.pad)
    return sorted(banned)
