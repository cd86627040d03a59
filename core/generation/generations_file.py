"""generate.py's output: one JSON record per finished continuation, appended (and flushed) in input order as each
is done, so a stopped or killed run keeps what it finished and a run with the same output continues after it.

  <output>                  one {"prompt", "sample", "text", "new_tokens", "stop"} per line, and "messages" for a
                            chat prompt (its conversation; "prompt": the text rendered from it); record k is
                            sample k % samples of prompt k // samples
  <output>.settings.json    what made them: the checkpoint, the prompts (count and SHA-256), the decoding, model
                            and tokenizer settings; written (whole or not at all) before the first record

An <output> that exists is continued only when its settings file says what this run would write and every complete
line is the record its position expects; a torn last line (a process killed while writing it) is dropped and made
again. Anything else is refused, naming the file and what differs: nothing written before is overwritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from core.checkpointing.output_files import write_atomically
from core.config.errors import ConfigError, DataError
from core.config.file_shape import read_small_file

log = logging.getLogger("generate")

SETTINGS_SUFFIX = ".settings.json"
SETTINGS_MAX_BYTES = 16 * 1024 * 1024  # the settings are a few hundred bytes; room for long paths and lists
RECORD_KEYS = ("prompt", "sample", "text", "new_tokens", "stop")
CHAT_KEY = "messages"  # a chat prompt's record has it too

# A prompt as its records name it: its text, or {"prompt": text, "messages": conversation} for a chat prompt.
PromptFields = Union[str, dict]


def _fields(prompt: PromptFields) -> dict:
    return {"prompt": prompt} if isinstance(prompt, str) else prompt


def settings_file(output: Path) -> Path:
    return output.with_name(output.name + SETTINGS_SUFFIX)


def prompts_identity(prompts: list[PromptFields]) -> dict:
    """The prompts as the settings file records them: how many, and the SHA-256 of all of them in order (a text's
    JSON, or a chat prompt's fields' JSON)."""
    digest = hashlib.sha256()
    for prompt in prompts:
        fields = _fields(prompt)
        digest.update(json.dumps(fields["prompt"] if len(fields) == 1 else fields).encode() + b"\n")
    return {"count": len(prompts), "sha256": digest.hexdigest()}


def continue_output(output: Path, settings: dict, prompts: list[PromptFields], samples: int) -> int:
    """Make `output` ready to be appended to; the number of records it already holds (0 for a new one), of the
    len(prompts) * samples the run writes in all."""
    for path in (output, settings_file(output)):
        if path.is_symlink() or (path.exists() and not path.is_file()):
            kind = "a symbolic link" if path.is_symlink() else "not a regular file"
            raise DataError(f"generate.output={output}: {path} is {kind}: choose another generate.output")
    if not output.exists():
        output.parent.mkdir(parents=True, exist_ok=True)
        _write_settings(settings_file(output), settings)
        return 0
    if not settings_file(output).exists():
        raise DataError(
            f"generate.output={output} exists and is not an output of generate.py (no "
            f"{settings_file(output).name} beside it): move it away, or choose another generate.output"
        )
    try:
        differences = _differences(_read_settings(settings_file(output)), settings)
    except RecursionError:  # objects inside objects, hundreds deep: not a file generate.py wrote
        raise DataError(
            f"{settings_file(output)}: nested too deeply to be the settings generate.py writes: move it "
            "and its output away, or choose another generate.output"
        ) from None
    if differences:
        raise ConfigError(
            f"generate.output={output} holds continuations made with other settings ("
            + "; ".join(differences)
            + "): run with those to continue it, or choose another "
            "generate.output"
        )
    done = _check_records(output, prompts, samples)
    total = len(prompts) * samples
    if done == total:
        log.info("%s holds all %d continuations already: nothing left to do", output, total)
    elif done:
        log.info("%s holds %d of %d continuations already: continuing after them", output, done, total)
    return done


def _write_settings(path: Path, settings: dict) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n"))


def _read_settings(path: Path) -> dict:
    try:
        settings = json.loads(read_small_file(path, SETTINGS_MAX_BYTES))
    except (OSError, ValueError, RecursionError) as e:  # (a UnicodeDecodeError is a ValueError)
        raise DataError(
            f"{path}: unreadable ({type(e).__name__}: {e}): move it and its output away, or choose "
            "another generate.output"
        ) from None
    if not isinstance(settings, dict):
        raise DataError(
            f"{path}: a JSON {type(settings).__name__}, not the settings generate.py writes: move it and "
            "its output away, or choose another generate.output"
        )
    return settings


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _differences(saved: dict, current: dict) -> list[str]:
    """`key: <saved> there, <current> now` for each setting that differs; the prompts by their count."""
    found = []
    if saved.get("prompts") != current["prompts"]:
        count = saved["prompts"].get("count") if isinstance(saved.get("prompts"), dict) else None
        found.append(
            f"the prompts (generate.prompt or generate.prompt_file): {count!r} there, "
            f"{current['prompts']['count']} now" + (", not the same" if count == current["prompts"]["count"] else "")
        )
    saved, current = _flat({**saved, "prompts": None}), _flat({**current, "prompts": None})
    return found + [
        f"{key}: {saved.get(key)!r} there, {current.get(key)!r} now"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]


def _complete_lines(output: Path) -> Iterator[tuple[int, bytes]]:
    """(offset after the line, line) for each line that ends in a newline."""
    offset = 0
    with open(output, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                return
            offset += len(line)
            yield offset, line


def _check_records(output: Path, prompts: list[PromptFields], samples: int) -> int:
    """How many records `output` holds, each checked against its position; a torn last line is cut off."""
    done, end = 0, 0
    for end, line in _complete_lines(output):
        if done >= len(prompts) * samples:
            raise DataError(
                f"generate.output={output}: more records than the {len(prompts) * samples} this run "
                "writes: move it away, or choose another generate.output"
            )
        record, (i, j) = _parse(line), divmod(done, samples)
        expected = _fields(prompts[i])
        if (
            record is None
            or any(record.get(k) != expected.get(k) for k in ("prompt", CHAT_KEY))
            or record["sample"] != j
        ):
            raise DataError(
                f"generate.output={output}: line {done + 1} is not the record of prompt {i + 1}, sample "
                f"{j + 1}: move it away, or choose another generate.output"
            )
        done += 1
    size = output.stat().st_size
    if size > end:
        log.warning(
            "%s: dropping its last line (%d bytes, cut off when the run writing it was killed); that "
            "continuation is made again",
            output,
            size - end,
        )
        os.truncate(output, end)
    return done


def _parse(line: bytes) -> Optional[dict]:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or set(record) - {CHAT_KEY} != set(RECORD_KEYS):  # (a chat prompt's has messages)
        return None
    return record if isinstance(record["prompt"], str) else None


class Appender:
    """Appends records to the output, each flushed as it is written (a stop or a kill keeps every finished one)."""

    def __init__(self, output: Path):
        self.path = output
        self.file = open(output, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "Appender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
