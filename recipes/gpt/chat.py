"""Chat and instruction rows -> token ids and a loss mask that covers exactly the assistant's tokens (SFT data).

Rows, from JSON Lines (.jsonl / .json: one object per line, parsed by the json module) or parquet (pyarrow, a batch
at a time, only the columns needed), are either `{"prompt": str, "response": str}` (one user turn, one assistant
turn) or `{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}` with at least one assistant
turn. Other keys are ignored. A bad row is a DataError naming the file and its line (JSON Lines) or row (parquet,
from 1): not an object, neither or both shapes, a missing or empty text, a text that is not a string or not valid
Unicode, an unknown role, no assistant turn, a line that is not UTF-8 or not JSON.

Rendering. A local Hugging Face tokenizer folder with a chat template (tokenizer_config.json's `chat_template`, or
chat_template.jinja) renders each conversation with transformers' `apply_chat_template` (the folder's own files
only: nothing downloads, no remote code). The loss mask is found by rendering prefixes: for each assistant message,
the conversation before it with the template's generation prompt (where the assistant's content starts) and the
conversation up to and including it (where its turn ends, the template's end-of-turn token included, so a model
learns to stop). Each prefix's token ids must be a prefix of the whole conversation's ids; a template for which
that does not hold (one that renders earlier turns differently once later ones follow, or whose text at a boundary
tokenizes differently alone) is refused, naming the tokenizer folder and the row, rather than a mask guessed; so is
one whose generation prompt does not end where the assistant's content starts (only whitespace may come between:
it is masked with the content).

Without a chat template (the byte tokenizer, or a folder without one) the plain template is used, each piece
tokenized on its own and the ids concatenated (so the mask is exact by construction):

    system turn     "<|system|>\\n" + content + "\\n"
    user turn       "<|user|>\\n" + content + "\\n"
    assistant turn  "<|assistant|>\\n" + content, then the tokenizer's end-of-document id (its end of turn)

with loss on the assistant's content and that end-of-document id. The markers are ordinary text, not special tokens.

Length. A conversation longer than `max_length` tokens is truncated to its first max_length tokens
(too_long=truncate; one left with no response token is dropped: nothing to learn from) or dropped (too_long=drop).
Both are counted in the returned ChatSummary.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from core.config.errors import DataError
from core.data.json_lines import json_lines
from core.data.parquet_text import TextRefused, text_batches
from recipes.gpt.options import DATA_CONFIG, Options, given
from recipes.gpt.template_sandbox import BoundedTemplate
from recipes.gpt.tokenizer import build_tokenizer, check_growth, panics_named, read_settings_file

ROLES = ("system", "user", "assistant")
PLAIN_HEADERS = {role: f"<|{role}|>\n" for role in ROLES}
PARQUET_BATCH_ROWS = 64  # rows decoded at once (each within the row groups' checked bounds)
MAX_TEXT_BYTES = 16 << 20  # a parquet prompt or response: far more than any max_length keeps
TEMPLATE_FILE = "chat_template.jinja"  # where transformers saves a folder's chat template besides tokenizer_config


class TooLong(StrEnum):
    truncate = "truncate"
    drop = "drop"


class Refusal(Exception):
    """A problem with one row; the reader adds the file and the line or row."""


@dataclass
class ChatSummary:
    """What reading a chat file did: rows read, kept, truncated (kept shortened), dropped, and tokens kept."""

    source: str
    max_length: int
    rows_read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    response_tokens: int = 0

    def line(self) -> str:
        return (
            f"{self.source}: {self.rows_read} rows read, {self.kept} kept ({self.truncated} truncated to "
            f"{self.max_length} tokens), {self.dropped} dropped (too long), {self.tokens} tokens of which "
            f"{self.response_tokens} response tokens (the loss's)"
        )


@dataclass
class ChatTokens:
    """The kept conversations in file order: row i is tokens[offsets[i]:offsets[i+1]] (int32), with loss_mask (bool,
    same length) True on the assistant's tokens."""

    source: str
    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        part = slice(self.offsets[i], self.offsets[i + 1])
        return self.tokens[part], self.loss_mask[part]


# --- rendering: messages -> (ids, mask) ----------------------------------------------------------------------
class PlainTemplate:
    """The plain template (module docstring) over a tokenizer of recipes.gpt.tokenizer (byte or HF folder)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.name = "the plain chat template"

    def render(self, messages: list[dict], max_length: Optional[int] = None) -> tuple[list[int], list[bool]]:
        """(ids, mask) of the conversation (max_length: unused, the plain template's cost is linear)."""
        ids: list[int] = []
        mask: list[bool] = []
        for message in messages:
            header = self.tokenizer.encode(PLAIN_HEADERS[message["role"]])
            ids += header
            mask += [False] * len(header)
            content = [int(i) for i in self.tokenizer.encode(message["content"])]
            if message["role"] == "assistant":
                content.append(self.tokenizer.eod)
                ids += content
                mask += [True] * len(content)
            else:
                content += self.tokenizer.encode("\n")
                ids += content
                mask += [False] * len(content)
        return ids, mask

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation, then the assistant's header: where its reply starts (generate.py)."""
        return self.render(messages)[0] + [int(i) for i in self.tokenizer.encode(PLAIN_HEADERS["assistant"])]

    def prompt_text(self, messages: list[dict]) -> str:
        """The text of prompt_ids (an earlier assistant turn's end-of-document id has none)."""
        turns = [PLAIN_HEADERS[m["role"]] + m["content"] + ("" if m["role"] == "assistant" else "\n") for m in messages]
        return "".join(turns) + PLAIN_HEADERS["assistant"]

    def end_of_turn_ids(self) -> list[int]:
        """The ids that end an assistant's turn: the end-of-document id the template appends after it."""
        return [self.tokenizer.eod]


class HFChatTemplate:
    """A Hugging Face tokenizer folder's own chat template, the mask found by rendering prefixes."""

    def __init__(self, folder: Path, named: str):
        from transformers import PreTrainedTokenizerFast

        try:
            self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001 (a damaged folder raises many kinds)
            raise DataError(f"{named}: transformers cannot load it ({type(e).__name__}: {str(e)[:200]})") from None
        check_growth(self.tokenizer.backend_tokenizer, named)
        source = self.tokenizer.chat_template
        if not source:
            raise DataError(f"{named}: transformers finds no chat template there")
        if isinstance(source, dict) and all(isinstance(v, str) for v in source.values()):
            source = source.get("default")  # HF's named templates ([{name, template}]): the one it uses by default
        if not isinstance(source, str):
            raise DataError(
                f"{named}: chat_template is {type(source).__name__}, expected a string (or a list of "
                "{name, template} with a 'default')"
            )
        try:
            self.template = BoundedTemplate(source)
        except Exception as e:  # noqa: BLE001 (the template is someone else's code: any error is its own)
            raise DataError(
                f"{named}: its chat template does not compile ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        self.name = f"the chat template of {named}"

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        """What transformers' apply_chat_template(tokenize=False) renders, within the rendering's budget."""
        variables = {**self.tokenizer.special_tokens_map, "tools": None, "documents": None}
        try:
            return self.template.render(
                [dict(m) for m in messages], add_generation_prompt=generation_prompt, **variables
            )
        except Exception as e:  # noqa: BLE001 (the template is someone else's code: any error is its own)
            raise Refusal(f"{self.name} refuses this conversation ({type(e).__name__}: {str(e)[:200]})") from None

    def _ids(self, text: str) -> list[int]:
        with panics_named(self.name):
            return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def render(self, messages: list[dict], max_length: Optional[int] = None) -> tuple[list[int], list[bool]]:
        """(ids, mask) of the conversation; with `max_length`, the mask is found only for the assistant turns that
        start within the first max_length tokens (the others do not survive truncation), and a conversation of
        more messages than max_length (each renders to a token at least) is refused before any rendering."""
        if max_length is not None and len(messages) > max_length:
            raise Refusal(
                f"{len(messages)} messages, more than the {max_length} tokens a row holds (each message takes a "
                "token at least)"
            )
        whole = self._text(messages, False)
        ids = self._ids(whole)
        mask = [False] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start_text = self._text(messages[:i], True)
            start = self._ids(start_text)
            if max_length is not None and len(start) >= max_length:
                break  # this turn and later ones begin past the truncation
            end_text = self._text(messages[: i + 1], False)
            end = self._ids(end_text)
            self._check_turn(whole, start_text, end_text, message["content"])
            for name, prefix in (("start", start), ("end", end)):
                if ids[: len(prefix)] != prefix:
                    raise Refusal(
                        f"{self.name} cannot give a response-only loss mask: the conversation up to an assistant "
                        f"message's {name} does not tokenize as the start of the whole conversation (tokens merge "
                        "across the turn's boundary); use a template without that, or a tokenizer folder without a "
                        "chat template (the plain template)"
                    )
            mask[len(start) : len(end)] = [True] * (len(end) - len(start))
        return ids, mask

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation rendered with the template's generation prompt: where the assistant's reply starts
        (generate.py). Refusal when the template refuses it."""
        return self._ids(self._text(messages, True))

    def prompt_text(self, messages: list[dict]) -> str:
        """The text prompt_ids encodes: the template's rendering with its generation prompt."""
        return self._text(messages, True)

    def end_of_turn_ids(self) -> list[int]:
        """The ids that end an assistant's turn: the folder's eos_token, and the special token the template itself
        puts after an assistant's content when that is another (Llama 3's <|eot_id|>, ChatML's <|im_end|>)."""
        ids = [] if self.tokenizer.eos_token_id is None else [int(self.tokenizer.eos_token_id)]
        probe = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi there."}]
        try:
            start, end = self._text(probe[:1], True), self._text(probe, False)
        except Refusal:  # a template with rules of its own (a system turn first, ...): the eos_token alone
            return ids
        at = end.find(probe[1]["content"], len(start) if end.startswith(start) else 0)
        if at >= 0:
            after = end[at + len(probe[1]["content"]) :]
            special = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
            encoded = self._ids(after)
            first = next((i for i in encoded if i in special), None)  # the end of the turn, before any newline
            if first is not None and first not in ids:
                ids.append(first)
        return ids

    def _check_turn(self, whole: str, start: str, end: str, content: str) -> None:
        """The texts up to an assistant message's start and end begin the whole conversation, and between them
        comes the message's content first (nothing of the template's header: only whitespace before it)."""
        problem = None
        if not (whole.startswith(start) and whole.startswith(end) and end.startswith(start)):
            problem = "renders earlier turns differently once later ones follow"
        else:
            turn = end[len(start) :]
            at = turn.find(content.strip())
            if at < 0 or turn[:at].strip():
                problem = "does not end its generation prompt where the assistant's content starts"
        if problem:
            raise Refusal(
                f"{self.name} cannot give a response-only loss mask: it {problem}; use a template without that, "
                "or a tokenizer folder without a chat template (the plain template)"
            )


def chat_template(spec: str, eod_token: Optional[str] = None, options: Options = DATA_CONFIG):
    """What renders conversations for the tokenizer `spec` (byte, or a local HF folder): its chat template when the
    folder has one, else the plain template (`eod_token`: its end of turn, null: the folder's eos_token)."""
    folder = Path(spec) if Path(spec).is_dir() else Path(spec).parent  # a tokenizer.json: its folder's template,
    # the one recipes/gpt/hf.py exports with it
    if spec != "byte" and Path(spec).exists() and _has_template(folder, given(options.tokenizer, spec)):
        return HFChatTemplate(folder, given(options.tokenizer, spec))
    return PlainTemplate(build_tokenizer(spec, eod_token, options))


def _has_template(folder: Path, named: str) -> bool:
    config = folder / "tokenizer_config.json"
    in_config = config.is_file() and bool(read_settings_file(config, named).get("chat_template"))
    return in_config or (folder / TEMPLATE_FILE).is_file()


# --- reading rows ----------------------------------------------------------------------------------------------
def read_chat(
    path: str | Path, setting: str, renderer, max_length: int, too_long: TooLong | str = TooLong.truncate
) -> tuple[ChatTokens, ChatSummary]:
    """The conversations of `path` (which `setting` gave: data.train_path, ...) rendered by `renderer` (see
    chat_template), and what was done. Refuses the first bad row (DataError naming the file and line or row)."""
    path, too_long = Path(path), TooLong(too_long)
    source = f"{setting}={path}"
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{source}: expected a .jsonl or .parquet file of chat rows")
    if not path.is_file():
        raise DataError(f"{source}: no such file")
    summary = ChatSummary(source, max_length)
    tokens, mask, lengths = array.array("i"), bytearray(), array.array("q")
    rows = _parquet_rows(path, source, max_length) if suffix == ".parquet" else _jsonl_rows(path, source)
    for where, row in rows:
        summary.rows_read += 1
        try:
            ids, loss = renderer.render(_messages(row), max_length)
        except Refusal as e:
            raise DataError(f"{source}: {where}: {e}") from None
        if len(ids) > max_length:
            if too_long is TooLong.drop or not any(loss[:max_length]):
                summary.dropped += 1
                continue
            ids, loss = ids[:max_length], loss[:max_length]
            summary.truncated += 1
        summary.kept += 1
        summary.response_tokens += sum(loss)
        tokens.extend(ids)
        mask.extend(loss)
        lengths.append(len(ids))
    if summary.rows_read == 0:
        raise DataError(f"{source}: no rows")
    summary.tokens = len(tokens)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
    out = ChatTokens(source, np.frombuffer(tokens, dtype=np.int32).copy(), np.frombuffer(mask, dtype=bool), offsets)
    return out, summary


def _messages(row: Any) -> list[dict]:
    """The row's conversation as [{"role", "content"}] (Refusal on any problem)."""
    if not isinstance(row, dict):
        raise Refusal(f"a JSON {type(row).__name__}, expected an object with prompt and response, or messages")
    has_messages = row.get("messages") is not None
    has_pair = row.get("prompt") is not None or row.get("response") is not None
    if has_messages == has_pair:
        raise Refusal(
            ("both messages and prompt/response" if has_messages else "neither messages nor prompt/response")
            + ": expected one of {'prompt': text, 'response': text} or {'messages': [{'role', 'content'}, ...]}"
        )
    if has_pair:
        return [
            {"role": "user", "content": _text(row.get("prompt"), "prompt")},
            {"role": "assistant", "content": _text(row.get("response"), "response")},
        ]
    value = row["messages"]
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        raise Refusal(f"messages is {_shown(value)}, expected a non-empty list of {{'role', 'content'}} objects")
    messages = [_message(m, i) for i, m in enumerate(value, start=1)]
    if not any(m["role"] == "assistant" for m in messages):
        raise Refusal("no assistant message (nothing to learn from)")
    return messages


def _message(value: Any, number: int) -> dict:
    if not isinstance(value, dict):
        raise Refusal(f"message {number} is {_shown(value)}, expected an object with role and content")
    role = value.get("role")
    if role not in ROLES:
        raise Refusal(f"message {number}: role {_shown(role)}, expected one of {', '.join(ROLES)}")
    return {"role": role, "content": _text(value.get("content"), f"message {number}'s content")}


def _text(value: Any, what: str) -> str:
    if value is None:
        raise Refusal(f"no {what}")
    if not isinstance(value, str):
        raise Refusal(f"{what} is {_shown(value)}, expected text")
    if not value.strip():
        raise Refusal(f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Refusal(f"{what} is not valid Unicode text ({e.reason} at character {e.start + 1})") from None
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _jsonl_rows(path: Path, source: str) -> Iterator[tuple[str, Any]]:
    for number, row in json_lines(path, source):
        yield f"line {number}", row


def _parquet_rows(path: Path, source: str, max_length: int) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
        columns = [c for c in ("messages", "prompt", "response") if c in names]
        if not columns:
            raise DataError(
                f"{source}: no messages, prompt or response column (its columns: {', '.join(map(repr, names))})"
            )
        _check_row_groups(file, source, columns, max_length)
        number = 0
        for batch in text_batches(path, columns, MAX_TEXT_BYTES, PARQUET_BATCH_ROWS):  # every text bounded
            for row in batch.to_pylist():
                number += 1
                yield f"row {number}", row
    except TextRefused as e:
        raise DataError(f"{source}: {e}") from None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{source}: not a readable parquet file ({e})") from None


def _check_row_groups(file, source: str, columns: list[str], max_length: int) -> None:
    """Refuses, from the file's metadata and before reading it, a row group whose columns hold more values than its
    rows can use: each message takes a token at least, so a row needs no more than max_length of them (a few
    compressed bytes can otherwise expand to gigabytes of messages)."""
    meta = file.metadata
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        cap = (group.num_rows + 1) * max_length
        for c in range(group.num_columns):
            column = group.column(c)
            top = column.path_in_schema.split(".")[0]
            if top in columns and column.num_values > cap:
                raise DataError(
                    f"{source}: row group {g + 1} ({group.num_rows} rows) holds {column.num_values:,} values of "
                    f"{column.path_in_schema}, more than its rows can use ({max_length} tokens a row, a message "
                    "takes one at least)"
                )


# --- prompts for generation ------------------------------------------------------------------------------------
def prompt_messages(value: Any) -> list[dict]:
    """A prompt's conversation for generate.py ([{"role", "content"}], the messages of a chat row) that the model is
    to answer: its last message from the user or the system. Refusal on any problem."""
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        raise Refusal(f"messages is {_shown(value)}, expected a non-empty list of {{'role', 'content'}} objects")
    messages = [_message(m, i) for i, m in enumerate(value, start=1)]
    if messages[-1]["role"] == "assistant":
        raise Refusal(
            f"message {len(messages)} (the last) is the assistant's: a prompt ends with the user's or the system's "
            "message, which the model answers"
        )
    return messages
