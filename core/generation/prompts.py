"""generate.py's prompts: generate.prompt, or generate.prompt_file read as text, one prompt per line, or as JSON Lines,
a "prompt" text or a chat conversation ("messages") per line; then each made into the token ids the model continues.

A text is encoded by the tokenizer as it is (with generate.chat=true: as the one user message of a conversation). A
conversation is rendered by the recipe's chat template with its generation prompt (for the GPT: recipes/gpt/chat.py),
so the model continues where the assistant's reply starts, and stops at the template's end of turn. Every text must
be one a tokenizer can encode (`lone_surrogate`, which the GPT's preprocessing checks its documents with too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from core.config.errors import DataError
from core.config.file_shape import NotThisKindOfFile, read_small_file
from core.data.json_lines import json_lines

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_LINE_END = re.compile("\r\n|\r|\n")


def lone_surrogate(text: str) -> bool:
    """Whether `text` holds a lone UTF-16 surrogate (JSON's "\\ud800" escapes give them): no tokenizer encodes it."""
    return not text.isascii() and _LONE_SURROGATE.search(text) is not None


@dataclass(frozen=True)
class Prompt:
    """A prompt as given: a text, or a conversation (a .jsonl row's "messages", checked when rendered)."""

    text: Optional[str] = None
    messages: Any = None
    where: str = "generate.prompt"  # what gave it, for errors: generate.prompt_file=<file>: line <n>


@dataclass(frozen=True)
class Rendered:
    """A prompt ready for the model: its token ids, the text they stand for (the output's "prompt") and, for a
    conversation, its messages (the output's "messages")."""

    text: str
    ids: list[int]
    messages: Optional[list[dict]] = None

    def fields(self) -> dict:
        """The output record's fields that name the prompt (core/generation/generations_file.py)."""
        return {"prompt": self.text} if self.messages is None else {"prompt": self.text, "messages": self.messages}


def read_prompts(path: Path) -> list[Prompt]:
    """One prompt per non-empty line; in a .jsonl file (any case: .JSONL too), a {"prompt": text} or {"messages": [...]}
    object per line."""
    source = f"generate.prompt_file={path}"
    if not path.is_file():
        raise DataError(f"{source}: no such file")
    prompts = _json_prompts(path, source) if path.suffix.lower() == ".jsonl" else _text_prompts(path, source)
    for prompt in prompts:
        if prompt.text is not None and lone_surrogate(prompt.text):
            raise DataError(f"{prompt.where}: the prompt holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text")
    if not prompts:
        raise DataError(f"{source} holds no prompt")
    return prompts


# A prompt file far larger than any list of prompts (a sparse file, a wrong path) is refused before it is read.
PROMPT_FILE_MAX_BYTES = 256 << 20


def _text_prompts(path: Path, source: str) -> list[Prompt]:
    try:
        raw = read_small_file(path, PROMPT_FILE_MAX_BYTES, follow_symlinks=True)
        text = raw.decode("utf-8-sig")  # a byte-order mark is no prompt text
    except NotThisKindOfFile as e:
        raise DataError(f"{source}: {e}") from None
    except OSError as e:
        raise DataError(f"{source}: unreadable ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{source}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    # Lines end at \n, \r\n or \r only, as in preprocess: str.splitlines() would also cut one prompt at a form
    # feed, NEL or U+2028/U+2029 inside it.
    lines = enumerate(_LINE_END.split(text), start=1)
    return [Prompt(line, where=f"{source}: line {n}") for n, line in lines if line.strip()]


def _json_prompts(path: Path, source: str) -> list[Prompt]:
    prompts = []
    for n, row in json_lines(path, source):
        where = f"{source}: line {n}"
        has_text = isinstance(row, dict) and row.get("prompt") is not None
        has_messages = isinstance(row, dict) and row.get("messages") is not None
        if has_text == has_messages or (has_text and not isinstance(row["prompt"], str)):
            raise DataError(
                f'{where}: expected a JSON object with a "prompt" string or a "messages" list '
                '([{"role": "user", "content": "..."}, ...]), one of them'
            )
        prompts.append(
            Prompt(row["prompt"], where=where) if has_text else Prompt(messages=row["messages"], where=where)
        )
    return prompts


def render_prompts(prompts: list[Prompt], recipe, chat: bool) -> list[Rendered]:
    """Each prompt's token ids: a text encoded by `recipe.tokenizer` (with `chat`: as the one user message of a
    conversation), a conversation rendered by `recipe.chat_prompt` (DataError naming the prompt when refused)."""
    rendered = []
    for prompt in prompts:
        messages = prompt.messages
        if prompt.text is not None and chat:
            messages = [{"role": "user", "content": prompt.text}]
        if messages is None:
            ids = recipe.tokenizer.encode(prompt.text)
            if not ids:
                raise DataError(f"{prompt.where}: the prompt is empty")
            rendered.append(Rendered(prompt.text, [int(i) for i in ids]))
            continue
        try:
            messages, text, ids = recipe.chat_prompt(messages)
        except ValueError as e:
            raise DataError(f"{prompt.where}: {e}") from None
        rendered.append(Rendered(text, ids, messages))
    return rendered
