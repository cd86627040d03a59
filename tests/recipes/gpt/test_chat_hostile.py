"""Chat data and tokenizer folders written by someone hostile: a chat template, a conversation or a parquet file
that would cost gigabytes or minutes is refused in one line, before the expensive work."""

from __future__ import annotations

import json
import time

import pytest

from core.config.errors import DataError
from recipes.gpt.chat import HFChatTemplate, PlainTemplate, chat_template, read_chat
from tests.recipes.gpt.test_chat import LLAMA3_LIKE, MULTI_TURN, PAIR, _bpe_folder, _jsonl

HOSTILE = {
    "nested loops": "{% for i in messages * 5000 %}{% for j in messages * 5000 %}{% endfor %}{% endfor %}",
    "huge range": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "repetition": "{{ 'x' * 3000000000 }}",
    "format width": "{{ '{0:>3000000000}'.format(1) }}",
    "percent width": "{{ '%3000000000d' % 1 }}",
    "filter width": "{{ 'x'|center(3000000000) }}",
    "power": "{{ 10 ** 10000000 }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "output": "{% for i in range(60000) %}{{ messages }}{% endfor %}",
    "division by zero": "{{ 1 // 0 }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_costly_or_failing_template_refuses_the_row_in_one_line(tmp_path, name):
    folder = _bpe_folder(tmp_path / "tok", HOSTILE[name], where="tokenizer_config")
    started = time.process_time()
    with pytest.raises(DataError, match=r"chat.jsonl: line 1: the chat template of .*tok refuses this conversation"):
        read_chat(_jsonl(tmp_path / "chat.jsonl", [PAIR]), "data.train_path", chat_template(str(folder)), 64)
    assert time.process_time() - started < 5


@pytest.mark.parametrize("value", [5, ["not", "named"], {"a": 1}])
def test_a_chat_template_not_text_is_refused_naming_the_folder(tmp_path, value):
    folder = _bpe_folder(tmp_path / "tok", None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": value}))
    with pytest.raises(DataError, match=r"tok"):
        HFChatTemplate(folder, str(folder))


def test_the_bounded_rendering_is_transformers_rendering(tmp_path):
    folder = _bpe_folder(tmp_path / "tok", LLAMA3_LIKE)
    renderer = chat_template(str(folder))
    messages = MULTI_TURN["messages"]
    for prompt in (False, True):
        ours = renderer._text(messages, prompt)
        assert ours == renderer.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def test_many_turns_are_refused_before_rendering_and_late_turns_not_rendered(tmp_path, monkeypatch):
    renderer = chat_template(str(_bpe_folder(tmp_path / "tok", LLAMA3_LIKE)))
    turns = [{"role": r, "content": "two plus two"} for r in ("user", "assistant")] * 20
    rendered = []
    monkeypatch.setattr(renderer.template, "render", lambda m, **kw: rendered.append(len(m)) or "")
    with pytest.raises(DataError, match=r"line 1: 40 messages, more than the 30 tokens"):
        read_chat(_jsonl(tmp_path / "many.jsonl", [{"messages": turns}]), "data.train_path", renderer, 30)
    assert rendered == []
    monkeypatch.undo()
    whole, _ = renderer.render(turns)
    counts = []
    original = renderer._text
    monkeypatch.setattr(renderer, "_text", lambda m, p: counts.append(len(m)) or original(m, p))
    ids, mask = renderer.render(turns, max_length=len(whole) // 4)
    assert max(counts[1:]) < 20  # prefixes stop once they start past max_length tokens
    full_ids, full_mask = renderer.render(turns)
    assert ids == full_ids and mask[: len(whole) // 4] == full_mask[: len(whole) // 4]


def test_a_parquet_row_group_with_too_many_values_is_refused_from_its_metadata(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 10_000
    structs = pa.StructArray.from_arrays([pa.array(["user"] * n), pa.array(["hi"] * n)], names=["role", "content"])
    table = pa.table({"messages": pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), structs)})
    pq.write_table(table, tmp_path / "bomb.parquet")
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: pytest.fail("read before the check"))
    with pytest.raises(DataError, match=r"bomb.parquet: row group 1 \(1 rows\) holds 10,000 values of messages"):
        read_chat(tmp_path / "bomb.parquet", "data.train_path", chat_template("byte"), 64)


def test_a_tokenizer_json_spec_uses_its_folders_template(tmp_path):
    folder = _bpe_folder(tmp_path / "tok", LLAMA3_LIKE)
    assert isinstance(chat_template(str(folder / "tokenizer.json")), HFChatTemplate)
    assert isinstance(chat_template(str(_bpe_folder(tmp_path / "plain", None) / "tokenizer.json")), PlainTemplate)


LONG = "{% set c = 'x' * 12000 %}"  # within the size limit of PAIR's conversation: each product below is not
PRODUCTS = {
    "replace method": LONG + "{{ c.replace('', c) }}",
    "replace filter": LONG + "{{ c|replace('', c) }}",
    "join filter": LONG + "{{ c|join(c) }}",
    "join method": LONG + "{{ c.join(c) }}",
    "translate": LONG + "{{ c.translate({120: c}) }}",
    "expandtabs": "{% set t = '\\t' * 12000 %}{{ t.expandtabs(12000) }}",
    "indent": "{% set c = 'x\\n' * 6000 %}{{ c|indent(c) }}",
    "wordwrap": LONG + "{{ ('x ' * 6000)|wordwrap(1, wrapstring=c) }}",
    "tojson indent": "{% set c = 'x' * 6000 %}{{ c|list|tojson(indent=c) }}",
    "references printed": LONG + "{{ [c] * 12000 }}",
    "references concatenated": LONG + "{{ ([c] * 12000) ~ '' }}",
    "references formatted": LONG + "{{ '%s' % ([c] * 12000,) }}",
    "references to a filter": LONG + "{{ ([c] * 12000)|string }}",
    "references in a loop": LONG + "{% set ns = namespace(l=[]) %}{% for i in range(12000) %}"
    "{% set ns.l = ns.l + [c] %}{% endfor %}{{ ns.l|length }}{{ ns.l }}",
    "lorem ipsum": "{{ lipsum(2000, False, 2000, 2000) }}",
}


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_a_template_whose_result_is_a_product_of_its_inputs_is_refused_before_making_it(tmp_path, name):
    # Each value is within the limit, but replacing, joining, indenting ... one with another, or printing many
    # references to it, makes their product: refused before it is made, not after (~150 MB here, GBs for long rows).
    import tracemalloc

    folder = _bpe_folder(tmp_path / "tok", PRODUCTS[name], where="tokenizer_config")
    renderer, rows = chat_template(str(folder)), _jsonl(tmp_path / "chat.jsonl", [PAIR])
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"chat.jsonl: line 1: .*refuses this conversation \(TooCostly"):
            read_chat(rows, "data.train_path", renderer, 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak >> 20} MiB"


def test_templates_that_format_tools_and_long_turns_still_render(tmp_path):
    template = (
        "{{ messages[:1]|tojson(indent=4) }}{% for m in messages %}{{ m.role|upper }}: "
        "{{ m.content|replace('\\n', ' ')|indent(2) }}\n{% endfor %}{{ messages|map(attribute='role')|join(', ') }}"
    )
    folder = _bpe_folder(tmp_path / "tok", template, where="tokenizer_config")
    renderer = chat_template(str(folder))
    messages = [{"role": "user", "content": "a b\nc " * 4000}, {"role": "assistant", "content": "four"}]
    assert renderer._text(messages, False) == renderer.tokenizer.apply_chat_template(messages, tokenize=False)


def test_a_folder_whose_normalizer_multiplies_a_text_is_refused_for_its_chat_template_too(tmp_path):
    from tokenizers import Tokenizer, normalizers

    folder = _bpe_folder(tmp_path / "tok", LLAMA3_LIKE)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("e", "e" * 100)] * 3)  # an "e" becomes a million
    tok.save(str(folder / "tokenizer.json"))
    with pytest.raises(DataError, match=r"tok: its normalizer's Replace and Prepend rules can make a text 1,000,000"):
        chat_template(str(folder))
