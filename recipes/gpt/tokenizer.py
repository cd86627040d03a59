"""Tokenizers for the GPT recipe: a byte-level one (no download, exact round trip) and any local
Hugging Face tokenizer folder (its tokenizer.json, read with the `tokenizers` library).

Both give what Megatron-Core's datasets need from a tokenizer: `vocab_size`, `eod` (the end-of-document
id appended after each document), `pad`, and `unique_identifiers` (part of the dataset cache's key).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import numpy as np

from core.config.errors import DataError
from core.config.file_shape import NotThisKindOfFile, read_small_file, shown
from recipes.gpt.options import DATA_CONFIG, Options, given


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, end-of-document 256, padding 257: any text, no vocabulary file, and
    decode(encode(text)) == text exactly."""

    name = "byte"
    vocab_size = 258
    eod = 256
    pad = 257

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(tokenizer="byte", vocab_size=self.vocab_size, eod=self.eod)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """encode() of each text, as arrays (a byte array is its ids: no Python int per byte)."""
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


# tokenizer.json and its settings files: those of the largest vocabularies are tens of MB; a file far larger (a
# sparse file, a wrong path) is refused before it is read into memory.
TOKENIZER_FILE_MAX_BYTES = 256 << 20


def read_tokenizer_file(file: Path, where: str) -> bytes:
    """A tokenizer folder's file, at most TOKENIZER_FILE_MAX_BYTES (symbolic links followed: Hugging Face's
    cache links to its blobs); DataError `<where>: <reason>` when it is not a regular file, too large or
    unreadable."""
    try:
        return read_small_file(file, TOKENIZER_FILE_MAX_BYTES, follow_symlinks=True)
    except NotThisKindOfFile as e:
        raise DataError(f"{where}: {e}") from None
    except OSError as e:
        raise DataError(f"{where}: unreadable ({e.strerror or e})") from None


@contextlib.contextmanager
def panics_named(tokenizer: str):
    """The tokenizers library stops on a rule it cannot run (a pre-tokenizer pattern that backtracks past the regex
    engine's limit) with a Rust panic, a BaseException: one line naming the tokenizer instead."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise DataError(
            f"{tokenizer}: the tokenizer failed on the text ({shown(str(e))}); its tokenizer.json's rules (a "
            "pre-tokenizer pattern?) cannot be run on it"
        ) from None


class HFTokenizer:
    """A local Hugging Face tokenizer folder (or its tokenizer.json). End of document: `eod_token`, or
    the folder's eos_token (tokenizer_config.json / special_tokens_map.json). `options` name the settings (or
    command-line options) that gave the folder and the token, in errors."""

    def __init__(self, path: str, eod_token: Optional[str] = None, options: Options = DATA_CONFIG):
        from tokenizers import Tokenizer

        folder, named = Path(path), given(options.tokenizer, path)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if not file.is_file():
            raise DataError(f"{named}: no tokenizer.json there (give a local Hugging Face tokenizer folder, or 'byte')")
        self.name = str(folder)
        raw = read_tokenizer_file(file, f"{named}: {file}")
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
            raise DataError(
                f"{named}: {file}: not a tokenizer.json the tokenizers library reads ({type(e).__name__}: "
                f"{str(e)[:200]}); a Git LFS pointer or a truncated download?"
            ) from None
        self.sha256 = hashlib.sha256(raw).hexdigest()  # the vocabulary itself: a file replaced in place differs
        check_growth(self._tok, f"{named}: {file}")
        # Saved for a model's inputs, they would cut or pad every document: a document's ids are its text's alone.
        self._tok.no_truncation()
        self._tok.no_padding()
        given_eod = eod_token
        eod_token = eod_token or _eos_token(file.parent, named, options.eod_token)
        if eod_token is None:
            raise DataError(
                f"{named}: no eos_token in its tokenizer_config.json or special_tokens_map.json; give "
                f"the end-of-document token ({options.eod_token}, e.g. '</s>' or '<|endoftext|>')"
            )
        eod = self._tok.token_to_id(eod_token)
        if eod is None:
            said = given(options.eod_token, given_eod) if given_eod else "its eos_token"
            raise DataError(f"{named}: the end-of-document token {eod_token!r} ({said}) is not in the vocabulary")
        self.eod, self.eod_token = eod, eod_token
        self.vocab_size = _vocab_size(self._tok.get_vocab(with_added_tokens=True), f"{named}: {file}")
        self.pad = self.vocab_size  # never produced: Megatron-Core only needs it to differ from eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(tokenizer=self.name, vocab_size=self.vocab_size, eod=self.eod, sha256=self.sha256)

    def encode(self, text: str) -> list[int]:
        with panics_named(self.name):
            return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, the texts encoded in parallel (no character offsets: ids only)."""
        with panics_named(self.name):
            return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eod], skip_special_tokens=False)


def _vocab_size(vocab: dict[str, int], where: str) -> int:
    """The highest id + 1, not the count of tokens: a vocabulary may leave ids unused. But not many: the model
    gets a row per id (an id near 2**31 asks for an embedding of billions of rows), and ids are stored as int32."""
    token, top = max(vocab.items(), key=lambda item: item[1])
    if top > np.iinfo(np.int32).max - 1 or top >= 2 * len(vocab) + (1 << 17):
        raise DataError(
            f"{where}: the token {shown(token)} has the id {top}, far beyond its {len(vocab)} tokens (the model "
            "would get a row for every id up to it); fix its id, or remove it"
        )
    return top + 1


# How many times longer its normalizer (or decoder) may make a text: a real one replaces a character with one or two
# (Llama's "▁", T5's runs of spaces), but a sequence of replacements each multiplying a character multiplies the
# text by their product, inside the tokenizers library where nothing bounds it.
MAX_GROWTH = 64


def check_growth(tok, where: str) -> None:
    """Refuses (DataError naming `where`) a tokenizer whose normalizer or decoder can make a text more than
    MAX_GROWTH times longer, by the worst case of its Replace and Prepend rules (from their JSON: cheap)."""
    for part in ("normalizer", "decoder"):
        rules = getattr(tok, part)
        growth = _growth(json.loads(rules.__getstate__())) if rules is not None else 1
        if growth > MAX_GROWTH:
            raise DataError(
                f"{where}: its {part}'s Replace and Prepend rules can make a text {growth:,.0f} times longer "
                f"(more than {MAX_GROWTH}): a character replaced by many, again and again; fix or remove them"
            )


def _growth(rule) -> float:
    """How many times longer `rule` (a normalizer's or decoder's JSON) can make a text of one character or more."""
    if not isinstance(rule, dict):
        return 1.0
    kind = rule.get("type")
    if kind == "Sequence":
        parts = rule.get("normalizers") or rule.get("decoders") or []
        return float(np.prod([_growth(r) for r in parts])) if parts else 1.0
    if kind == "Prepend":  # once a text: a text of one character at worst
        return 1.0 + len(str(rule.get("prepend", "")))
    if kind != "Replace":
        return 1.0  # the Unicode forms, lowercasing, stripping, ...: bounded by Unicode, and not compounded
    content, pattern = str(rule.get("content", "")), rule.get("pattern") or {}
    if isinstance(pattern.get("String"), str) and pattern["String"]:
        return max(1.0, len(content) / len(pattern["String"]))
    return 1.0 + len(content) if _matches_empty(pattern.get("Regex")) else max(1.0, len(content))


def _matches_empty(regex) -> bool:
    """Whether a Replace rule's pattern may match no characters (then it inserts its content between all of them);
    a pattern Python's re cannot read (the library's regex engine differs) is taken to."""
    try:
        return re.compile(str(regex)).search("") is not None
    except (re.error, RecursionError, OverflowError):
        return True


SETTINGS_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # where the special tokens are declared


def read_settings_file(file: Path, named: str = "") -> dict:
    """A tokenizer folder's tokenizer_config.json or special_tokens_map.json. One that is not a JSON object is
    refused (DataError naming it, after `named`: what gave the folder), not skipped: the special tokens it should
    declare would silently come from the other file, or be missing, and Hugging Face's own loaders fail on it too."""
    where = f"{named}: {file}" if named else str(file)
    raw = read_tokenizer_file(file, where)
    try:
        settings = json.loads(raw)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8 or JSON, or a too long integer
        raise DataError(
            f"{where}: unreadable as JSON ({type(e).__name__}: {e}); fix or remove it, then run again"
        ) from None
    if not isinstance(settings, dict):
        raise DataError(
            f"{where}: a JSON {type(settings).__name__}, expected an object of the tokenizer's settings "
            "(eos_token, ...); fix or remove it, then run again"
        )
    return settings


def _eos_token(folder: Path, named: str, eod_option: str) -> Optional[str]:
    for name in SETTINGS_FILES:
        file = folder / name
        if file.is_file():
            token = read_settings_file(file, named).get("eos_token")
            if isinstance(token, dict):  # an AddedToken
                token = token.get("content")
            if token is not None and not isinstance(token, str):
                raise DataError(
                    f"{named}: {file}: eos_token is {shown(token)}, expected a token's text (or an object "
                    f'with its "content"); fix it, or give the end-of-document token ({eod_option})'
                )
            if token:
                return token
    return None


def build_tokenizer(spec: str, eod_token: Optional[str] = None, options: Options = DATA_CONFIG):
    """`byte`, or the path of a local Hugging Face tokenizer folder / tokenizer.json (`options` name the settings
    that gave them, in errors)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, eod_token, options)
