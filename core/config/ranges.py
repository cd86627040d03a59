"""The valid values of a config's numeric settings: small rules that each schema lists by field name.

A schema's types refuse text where a number belongs, but not the numbers nothing downstream can use: NaN,
infinities, a probability above 1, a size of 0, or a typo like 1e300 that overflows far from the config.
So every numeric field of a schema has a rule in the schema's `RANGES` table, with a lower and an upper
bound (tests/unit/config/test_ranges.py fails for a field without one), and `validation.validate` applies the
tables before any work, naming the key, the value and what was expected. A table is inherited: a recipe's `data`
schema also applies `DataConfig`'s rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from core.config.errors import ConfigError

# The largest count or seed: what an int32 holds (torch indices, numpy seeds with a rank added).
INT32_MAX = 2**31 - 1

# The smallest epsilon added to a variance or a root mean square before dividing by it (optimizer, norms):
# far from the smallest normal fp32 / bf16 number (1.2e-38). A denormal one may be flushed to 0 on GPUs,
# and below 1.4e-45 it is 0 in fp32 (1e-320 gives NaN at the first zero variance); real ones are 1e-5 to 1e-15.
EPSILON_MIN = 1e-30


def is_real(value: Any) -> bool:
    """A finite number: not NaN, not infinite, and not a bool (which Python counts as an int)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True  # math.isfinite would overflow on a huge int; ints are finite anyway
    return isinstance(value, float) and math.isfinite(value)


def show(bound: float) -> str:
    """A bound as it reads best: 2**31 - 1, 1e15, 1e-6."""
    if bound == INT32_MAX:
        return "2**31 - 1"
    text = f"{bound:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")
    return text if isinstance(bound, float) else str(bound)


@dataclass(frozen=True)
class Real:
    """A finite number from low to high, both ends included unless open_low / open_high."""

    low: float
    high: float
    open_low: bool = False
    open_high: bool = False
    note: str = ""  # said after the range in the message, e.g. "0: no clipping"

    def accepts(self, value: Any) -> bool:
        if not is_real(value):
            return False
        above = self.low < value if self.open_low else self.low <= value
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def bounds(self, name: str) -> str:
        """e.g. `0 < lr <= 10`."""
        return (
            f"{show(self.low)} {'<' if self.open_low else '<='} {name} "
            f"{'<' if self.open_high else '<='} {show(self.high)}"
        )

    def expected(self, name: str) -> str:
        return self.bounds(name) + (f" ({self.note})" if self.note else "")

    def check(self, value: Any, key: str) -> None:
        """Raise ConfigError naming `key` unless `value` is valid; null passes (the field's type decides
        whether it may be null, and Optional fields give null a meaning of their own)."""
        if value is not None and not self.accepts(value):
            raise ConfigError(f"{key}={value}: expected {self.expected(key.rsplit('.', 1)[-1])}")


@dataclass(frozen=True)
class Int(Real):
    """A whole number from low to high, both included; `also`: one more value with a meaning of its own
    (e.g. -1 for "all")."""

    also: Optional[int] = None

    def accepts(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and (value == self.also or super().accepts(value))

    def expected(self, name: str) -> str:
        either = f"{self.also} or " if self.also is not None else ""
        return f"{either}an integer {super().expected(name)}"


@dataclass(frozen=True)
class Numbers:
    """A list of numbers, each valid for `each`: exactly `length` of them, or at least `min_length`;
    `ordered`: a [low, high] pair, low <= high."""

    each: Real
    length: Optional[int] = None
    min_length: int = 1
    ordered: bool = False

    def accepts(self, values: list) -> bool:
        count = len(values) == self.length if self.length is not None else len(values) >= self.min_length
        in_range = all(self.each.accepts(v) for v in values)
        return count and in_range and (not self.ordered or values == sorted(values))

    def expected(self, name: str) -> str:
        if self.length is not None:
            count = "two numbers" if self.length == 2 else f"{self.length} numbers"
        else:
            count = "one or more numbers" if self.min_length == 1 else f"{self.min_length} or more numbers"
        if self.ordered:
            return f"{count} {self.each.bounds('low <= high')}"
        return f"{count}, each {self.each.bounds(name)}"

    def check(self, value: Any, key: str) -> None:
        """Like Real.check, for a list."""
        if value is None:
            return
        values = list(value)
        if not self.accepts(values):
            raise ConfigError(f"{key}={values}: expected {self.expected(key.rsplit('.', 1)[-1])}")


Rule = Union[Real, Numbers]  # an Int is a Real


def rules_of(schema: Optional[type]) -> dict[str, Rule]:
    """A schema's `RANGES` table merged with those of the schemas it extends (its own entries win)."""
    rules: dict[str, Rule] = {}
    for cls in reversed(getattr(schema, "__mro__", ())):
        rules.update(vars(cls).get("RANGES", {}))
    return rules


# The bounds every transformer-block model config shares (recipes/gpt, recipes/esm2), merged into their RANGES.
TRANSFORMER_BLOCK_RANGES: dict[str, Rule] = {
    "hidden_size": Int(1, INT32_MAX),
    "num_layers": Int(1, INT32_MAX),
    "num_attention_heads": Int(1, INT32_MAX),
    "ffn_hidden_size": Int(1, INT32_MAX),
    # The slowest rotating pair of dimensions turns once in about 2 pi base positions: far past any
    # sequence length at the upper bound; at 1 or below, every pair turns at least as fast as the first.
    "rotary_base": Real(1, 1e12, open_low=True),
    "norm_epsilon": Real(EPSILON_MIN, 1),
    # Weights are drawn from a normal truncated at +-2 std: torch divides by it, and it must stay > 0 in the
    # output projections' init_std / sqrt(2 num_layers); below 1e-6 they start as good as zero anyway.
    "init_std": Real(1e-6, 1),
    "hidden_dropout": Real(0, 1),
    "attention_dropout": Real(0, 1),
}
