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
