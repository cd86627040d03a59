"""generate.prompt_file's kind comes from its suffix in any case, as the chat data's does: a prompts.JSONL file is
JSON Lines (its rows' prompts), not text lines that hold JSON."""

from __future__ import annotations

import pytest

from core.generation.prompts import read_prompts


@pytest.mark.parametrize("name", ["p.jsonl", "p.JSONL", "p.JsonL"])
def test_a_jsonl_suffix_in_any_case_is_json_lines(tmp_path, name):
    path = tmp_path / name
    path.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    prompts = read_prompts(path)
    assert [p.text for p in prompts] == ["hi", None]
    assert prompts[1].messages == [{"role": "user", "content": "yo"}]


def test_other_suffixes_are_text_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('{"prompt": "hi"}\n')
    assert [p.text for p in read_prompts(path)] == ['{"prompt": "hi"}']


def test_a_prompt_file_far_larger_than_prompts_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from core.config.errors import DataError
    from core.generation import prompts

    monkeypatch.setattr(prompts, "PROMPT_FILE_MAX_BYTES", 1000)
    path = tmp_path / "p.txt"
    with open(path, "wb") as f:  # sparse: reading it whole would take its apparent size in memory
        f.write(b"hello\n")
        f.truncate(1001)
    with pytest.raises(DataError, match=r"p.txt: it is larger than 1000 bytes"):
        read_prompts(path)
    path.write_bytes(b"hello\n" * 100)
    assert len(read_prompts(path)) == 100


def test_text_prompt_lines_end_at_newlines_only(tmp_path):
    """A form feed, NEL or Unicode line separator inside a line is part of its prompt, as preprocess reads text."""
    path = tmp_path / "p.txt"
    path.write_text("first\u2028part\r\nTranslate: a\x0cb\rQ: caf\x85e?\x1e\n\nlast", encoding="utf-8", newline="")
    prompts = read_prompts(path)
    assert [p.text for p in prompts] == ["first\u2028part", "Translate: a\x0cb", "Q: caf\x85e?\x1e", "last"]
    assert [p.where.rsplit(": ", 1)[1] for p in prompts] == ["line 1", "line 2", "line 3", "line 5"]
