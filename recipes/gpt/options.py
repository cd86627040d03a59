"""How GPT data messages name what gave a file: the option on preprocess's command line (`--input a.txt`) or
the setting of a training config (`data.text_files=a.txt`). The same functions serve both, so each takes the
names its caller was given them by."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    input: str
    output_prefix: str
    tokenizer: str
    eod_token: str
    text_key: str


COMMAND_LINE = Options("--input", "--output-prefix", "--tokenizer", "--eod-token", "--text-key")
DATA_CONFIG = Options("data.text_files", "data.cache_dir", "data.tokenizer", "data.eod_token", "data.text_key")


def given(option: str, value) -> str:
    """`--input a.txt` or `data.text_files=a.txt`: the option or setting with the value it gave."""
    return f"{option} {value}" if option.startswith("-") else f"{option}={value}"
