"""generate.py's prompts: generate.prompt_file read as text, one prompt per line (or a JSON "prompt" per line), each
one a tokenizer can encode (`lone_surrogate`, which the GPT's preprocessing checks its documents with too)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from core.config.errors import DataError

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> bool:
    """Whether `text` holds a lone UTF-16 surrogate (JSON's "\\ud800" escapes give them): no tokenizer encodes it."""
    return not text.isascii() and _LONE_SURROGATE.search(text) is not None


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line, or a "prompt" field per line of a .jsonl file."""
    if not path.is_file():
        raise DataError(f"generate.prompt_file={path}: no such file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is no prompt text
    except OSError as e:
        raise DataError(f"generate.prompt_file={path}: unreadable ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"generate.prompt_file={path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        prompts = lines
    else:
        prompts = []
        for n, line in enumerate(lines, 1):
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
                prompt = None
            if not isinstance(prompt, str):
                raise DataError(f'generate.prompt_file={path}:{n}: expected a JSON object with a "prompt" string')
            prompts.append(prompt)
    for n, prompt in enumerate(prompts, 1):
        if lone_surrogate(prompt):
            raise DataError(
                f"generate.prompt_file={path}: prompt {n} holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text"
            )
    if not prompts:
        raise DataError(f"generate.prompt_file={path} holds no prompt")
    return prompts
