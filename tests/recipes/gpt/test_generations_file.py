"""generate.py's output file (core/generation/generations_file.py): continued only when it was made the same way, a
torn last line dropped, anything else refused by name with nothing overwritten."""

from __future__ import annotations

import json

import pytest

from core.config.errors import ConfigError, DataError
from core.generation.generations_file import Appender, continue_output, prompts_identity, settings_file

PROMPTS = ["Call me Ishmael.", "The whale", "Queequeg"]


def _settings(prompts=PROMPTS, **generate) -> dict:
    return {
        "checkpoint": {"init_from": "/ckpt/step_80", "bytes": 10, "modified_ns": 1},
        "prompts": prompts_identity(prompts),
        "generate": {"seed": 0, "temperature": 1.0, **generate},
    }


def _record(prompt: str, sample: int) -> dict:
    return {"prompt": prompt, "sample": sample, "text": f" and {sample}", "new_tokens": 2, "stop": "length"}


def _write(output, records) -> None:
    with Appender(output) as out:
        for record in records:
            out.append(record)


def test_a_new_output_then_a_continued_one(tmp_path, caplog):
    output = tmp_path / "out" / "generations.jsonl"
    assert continue_output(output, _settings(), PROMPTS, 2) == 0
    assert json.loads(settings_file(output).read_text()) == _settings()
    records = [_record(PROMPTS[0], 0), _record(PROMPTS[0], 1), _record(PROMPTS[1], 0)]
    _write(output, records)
    assert continue_output(output, _settings(), PROMPTS, 2) == 3
    # A process killed while writing record 4: its first bytes are there, without the newline.
    whole = output.read_bytes()
    with output.open("ab") as f:
        f.write(json.dumps(_record(PROMPTS[1], 1)).encode()[:20])
    with caplog.at_level("WARNING"):
        assert continue_output(output, _settings(), PROMPTS, 2) == 3
    assert output.read_bytes() == whole and "dropping its last line (20 bytes" in caplog.text
    _write(output, [_record(PROMPTS[1], 1), _record(PROMPTS[2], 0), _record(PROMPTS[2], 1)])
    assert continue_output(output, _settings(), PROMPTS, 2) == 6  # complete: nothing left to do


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(settings=_settings(temperature=0.5)), r"generate\.temperature: 1\.0 there, 0\.5 now"),
        (
            dict(settings=_settings(prompts=PROMPTS[:2])),
            r"the prompts \(generate\.prompt or generate\.prompt_file\): "
            r"3 there, 2 now",
        ),
        (dict(settings=_settings(prompts=["a", "b", "c"])), r"3 there, 3 now, not the same"),
        (
            dict(records=[_record(PROMPTS[0], 0), _record(PROMPTS[1], 0)]),
            r"line 2 is not the record of prompt 1, "
            r"sample 2",
        ),
        (dict(records=[_record(PROMPTS[0], 0), {"prompt": PROMPTS[0]}]), r"line 2 is not the record"),
        (
            dict(records=[_record(p, s) for p in PROMPTS for s in (0, 1)] + [_record("x", 0)]),
            r"more records than the 6",
        ),
    ],
)
def test_an_output_made_otherwise_is_refused_and_kept(tmp_path, change, says):
    output = tmp_path / "generations.jsonl"
    continue_output(output, _settings(), PROMPTS, 2)
    _write(output, change.get("records", [_record(PROMPTS[0], 0), _record(PROMPTS[0], 1)]))
    before = output.read_bytes(), settings_file(output).read_bytes()
    with pytest.raises(ConfigError, match=says):
        continue_output(output, change.get("settings", _settings()), PROMPTS, 2)
    assert (output.read_bytes(), settings_file(output).read_bytes()) == before


def test_a_file_generate_did_not_write_is_refused(tmp_path):
    output = tmp_path / "mine.jsonl"
    output.write_text("my own notes\n")
    with pytest.raises(
        DataError,
        match=r"generate\.output=.*mine\.jsonl exists and is not an output of generate\.py "
        r"\(no mine\.jsonl\.settings\.json beside it\)",
    ):
        continue_output(output, _settings(), PROMPTS, 1)
    assert output.read_text() == "my own notes\n" and not settings_file(output).exists()
    settings_file(output).write_text("[" * 100_000)
    with pytest.raises(DataError, match=r"mine\.jsonl\.settings\.json: unreadable \(RecursionError"):
        continue_output(output, _settings(), PROMPTS, 1)
    link = tmp_path / "link.jsonl"
    link.symlink_to(output)
    with pytest.raises(DataError, match="link.jsonl is a symbolic link"):
        continue_output(link, _settings(), PROMPTS, 1)
    with pytest.raises(DataError, match="is not a regular file"):
        continue_output(tmp_path, _settings(), PROMPTS, 1)
