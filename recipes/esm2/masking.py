"""What one sequence looks like to the model in one epoch: a random window of it (when longer than the model
takes), framed by <cls> and <eos>, with masked-language-model corruption (BERT's and ESM-2's recipe).

Every random draw comes from the generator the caller gives (core.data.datasets.sample_generator of the seed,
epoch and sequence): a sequence is cropped and masked the same way whichever pack, micro-batch, rank or loader
worker it lands in, and again after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recipes.esm2.tokenizer import CLS, EOS, MASK, SPECIAL, STANDARD_AMINO_ACIDS

IGNORE = -100  # the label of a token that is not predicted


@dataclass(frozen=True)
class Masking:
    fraction: float = 0.15  # share of residues selected for prediction
    replace_with_mask: float = 0.8  # of the selected: shown as <mask>
    replace_with_random: float = 0.1  # ... as a random standard amino acid; the rest keep their residue


def framed_length(residues, max_length: int):
    """Tokens of sequences of `residues` residues (an int or an array) once cropped to `max_length` tokens and
    framed by <cls> and <eos>."""
    return np.minimum(residues, max_length - 2) + 2


def crop_and_mask(
    residues: np.ndarray, max_length: int, masking: Masking, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """residues (token ids) -> (tokens, labels), int64 [framed_length]: labels hold the original token where it
    is to be predicted, IGNORE elsewhere. A longer sequence is cropped to a uniformly drawn window."""
    keep = max_length - 2
    if len(residues) > keep:
        start = int(torch.randint(0, len(residues) - keep + 1, (1,), generator=generator))
        residues = residues[start : start + keep]
    tokens = torch.cat(
        [torch.tensor([CLS]), torch.from_numpy(np.asarray(residues, dtype=np.int64)), torch.tensor([EOS])]
    )
    n = len(tokens)
    # Three draws per token, always, so that the stream of random numbers does not depend on the outcomes.
    select, how, random_residue = (
        torch.rand(n, generator=generator),
        torch.rand(n, generator=generator),
        torch.randint(STANDARD_AMINO_ACIDS.start, STANDARD_AMINO_ACIDS.stop, (n,), generator=generator),
    )
    selected = (select < masking.fraction) & ~torch.isin(tokens, torch.tensor(SPECIAL))
    labels = torch.where(selected, tokens, IGNORE)
    to_mask = selected & (how < masking.replace_with_mask)
    to_random = selected & ~to_mask & (how < masking.replace_with_mask + masking.replace_with_random)
    tokens = torch.where(to_mask, MASK, torch.where(to_random, random_residue, tokens))
    return tokens, labels
