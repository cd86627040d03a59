"""SFT chat data: rows -> token ids with a loss mask on exactly the assistant's tokens, with a tiny Hugging Face
tokenizer made here (a byte-level BPE trained on a few sentences), with and without a chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from core.config.errors import DataError
from recipes.gpt.chat import HFChatTemplate, PlainTemplate, Refusal, chat_template, prompt_messages, read_chat

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SENTENCES = ["the cat sat on the mat", "what is two plus two", "two plus two is four", "you are a helpful cat"]
MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "you are a helpful cat"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "two plus two is four"},
        {"role": "user", "content": "where is the cat"},
        {"role": "assistant", "content": "the cat sat on the mat"},
    ]
}
PAIR = {"prompt": "what is two plus two", "response": "four"}


def _bpe_folder(folder: Path, template: str | None, where: str = "jinja") -> Path:
    """A byte-level BPE tokenizer saved as transformers saves one; the template in chat_template.jinja (what
    save_pretrained writes), in tokenizer_config.json's chat_template (older folders), or none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token="<|eot_id|>")
    fast.save_pretrained(str(folder))
    if template is not None:
        if where == "jinja":
            (folder / "chat_template.jinja").write_text(template)
        else:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs of True in a mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def _responses(row: dict) -> list[str]:
    if "messages" in row:
        return [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    return [row["response"]]


@pytest.mark.parametrize("where", ["jinja", "tokenizer_config"])
def test_template_mask_is_exactly_each_response_and_its_end_of_turn(tmp_path, where):
    renderer = chat_template(str(_bpe_folder(tmp_path / "tok", LLAMA3_LIKE, where)))
    assert isinstance(renderer, HFChatTemplate)
    rows = [PAIR, MULTI_TURN]
    data, summary = read_chat(_jsonl(tmp_path / "chat.jsonl", rows), "data.train_path", renderer, 1000)
    assert (summary.rows_read, summary.kept, summary.truncated, summary.dropped) == (2, 2, 0, 0)
    decode = renderer.tokenizer.decode
    for i, row in enumerate(rows):
        ids, mask = data.row(i)
        assert ids.dtype == np.int32 and mask.dtype == bool and len(ids) == len(mask)
        assert [decode(ids[a:b]) for a, b in _runs(mask)] == [r + "<|eot_id|>" for r in _responses(row)]
        # everything else is the template and the other turns, whole: nothing of them is masked
        assert decode(ids) == renderer.tokenizer.apply_chat_template(row.get("messages") or _pair(row), tokenize=False)
    assert summary.response_tokens == int(data.loss_mask.sum())
    assert summary.tokens == len(data.tokens) == data.offsets[-1]


def _pair(row: dict) -> list[dict]:
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


@pytest.mark.parametrize("spec", ["byte", "folder"])
def test_plain_template_masks_each_response_and_the_end_of_document_id(tmp_path, spec):
    spec = spec if spec == "byte" else str(_bpe_folder(tmp_path / "tok", None))
    renderer = chat_template(spec)
    assert isinstance(renderer, PlainTemplate)
    rows = [PAIR, MULTI_TURN]
    data, summary = read_chat(_jsonl(tmp_path / "chat.jsonl", rows), "data.train_path", renderer, 1000)
    tokenizer = renderer.tokenizer
    for i, row in enumerate(rows):
        ids, mask = data.row(i)
        runs = _runs(mask)
        assert [int(ids[b - 1]) for _, b in runs] == [tokenizer.eod] * len(runs)
        assert [tokenizer.decode(ids[a : b - 1]) for a, b in runs] == _responses(row)
        text = tokenizer.decode(ids)  # the documented layout (decode leaves the end-of-document id out)
        assert text.startswith("<|system|>\nyou are a helpful cat\n<|user|>\n" if "messages" in row else "<|user|>\n")
    assert summary.response_tokens == int(data.loss_mask.sum()) > 0


def test_parquet_rows_read_as_their_jsonl_twins(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    renderer = chat_template(str(_bpe_folder(tmp_path / "tok", LLAMA3_LIKE)))
    rows = [MULTI_TURN, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    from_parquet, _ = read_chat(tmp_path / "chat.parquet", "data.train_path", renderer, 1000)
    from_jsonl, _ = read_chat(_jsonl(tmp_path / "chat.jsonl", rows), "data.train_path", renderer, 1000)
    for name in ("tokens", "loss_mask", "offsets"):
        np.testing.assert_array_equal(getattr(from_parquet, name), getattr(from_jsonl, name))
    pq.write_table(pa.Table.from_pylist([PAIR, PAIR]), tmp_path / "pairs.parquet")
    pairs, summary = read_chat(tmp_path / "pairs.parquet", "data.train_path", renderer, 1000)
    assert len(pairs) == summary.kept == 2


@pytest.mark.parametrize("too_long", ["truncate", "drop"])
def test_rows_too_long_are_truncated_or_dropped_and_counted(tmp_path, too_long):
    renderer = chat_template("byte")
    short = {"prompt": "a", "response": "b"}  # 9 + 2 + 14 + 2 = 27 byte tokens
    long_ = {"prompt": "a", "response": "b" * 100}
    path = _jsonl(tmp_path / "chat.jsonl", [short, long_, short, long_, long_])
    data, summary = read_chat(path, "data.train_path", renderer, 40, too_long)
    assert summary.rows_read == 5
    if too_long == "truncate":
        assert (summary.kept, summary.truncated, summary.dropped) == (5, 3, 0)
        lengths = np.diff(data.offsets)
        assert lengths.tolist() == [27, 40, 27, 40, 40]
        ids, mask = data.row(1)
        np.testing.assert_array_equal(ids, np.array(renderer.render(_pair(long_))[0][:40], np.int32))
        assert mask.sum() == 40 - 25  # the response's first bytes, no end of turn
    else:
        assert (summary.kept, summary.truncated, summary.dropped) == (2, 0, 3)
        assert np.diff(data.offsets).tolist() == [27, 27]
    assert summary.response_tokens == int(data.loss_mask.sum())
    assert f"{summary.dropped} dropped" in summary.line() and f"{summary.truncated} truncated" in summary.line()


def test_truncation_that_leaves_no_response_drops_the_row(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": "a" * 100, "response": "b"}])
    data, summary = read_chat(path, "data.train_path", chat_template("byte"), 40, "truncate")
    assert (summary.kept, summary.truncated, summary.dropped, len(data)) == (0, 0, 1, 0)


BAD_ROWS = [
    ("[1, 2]", "a JSON list, expected an object"),
    ('"text"', "a JSON str"),
    ("{}", "neither messages nor prompt/response"),
    ('{"prompt": "a"}', "no response"),
    ('{"prompt": "a", "response": "  "}', "response is empty"),
    ('{"prompt": 3, "response": "b"}', "prompt is int 3, expected text"),
    ('{"prompt": "a", "response": "b", "messages": []}', "both messages and prompt/response"),
    ('{"messages": []}', "messages is list [], expected a non-empty list"),
    ('{"messages": "hello"}', "messages is str"),
    ('{"messages": [["user", "hi"]]}', "message 1 is list"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "message 1: role str 'bot', expected one of"),
    ('{"messages": [{"role": "user"}]}', "no message 1's content"),
    ('{"messages": [{"role": "user", "content": ""}]}', "message 1's content is empty"),
    ('{"messages": [{"role": "user", "content": {"a": 1}}]}', "message 1's content is dict"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"prompt": "a", "response": "\\ud800"}', "response is not valid Unicode text"),
    ('{"prompt": "a", ', "is not JSON"),
    ("[" * 100_000 + "]" * 100_000, "nests its JSON too deeply"),
]


@pytest.mark.parametrize("line, says", BAD_ROWS, ids=[s for _, s in BAD_ROWS])
def test_bad_jsonl_rows_are_refused_by_file_and_line(tmp_path, line, says):
    path = _jsonl(tmp_path / "chat.jsonl", [PAIR, "", line, PAIR])
    with pytest.raises(DataError) as e:
        read_chat(path, "data.train_path", chat_template("byte"), 1000)
    assert f"data.train_path={path}: line 3" in str(e.value) and says in str(e.value)


def test_a_line_not_utf8_is_refused_by_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(json.dumps(PAIR).encode() + b'\n{"prompt": "caf\xe9", "response": "b"}\n')
    with pytest.raises(DataError, match=r"chat.jsonl: line 2 is not UTF-8 text"):
        read_chat(path, "data.train_path", chat_template("byte"), 1000)


def test_bad_parquet_rows_are_refused_by_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([PAIR, {"prompt": "a", "response": None}]), path)
    with pytest.raises(DataError, match=rf"data.val_path={path}: row 2: no response"):
        read_chat(path, "data.val_path", chat_template("byte"), 1000)
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(DataError, match="no messages, prompt or response column"):
        read_chat(path, "data.val_path", chat_template("byte"), 1000)


def test_a_template_rendering_earlier_turns_differently_is_refused(tmp_path):
    # like templates that drop an earlier answer's reasoning: the prefix is not the start of the whole
    template = LLAMA3_LIKE.replace("{{ m.content }}", "{% if loop.last %}{{ m.content }}{% else %}...{% endif %}")
    renderer = chat_template(str(_bpe_folder(tmp_path / "tok", template)))
    path = _jsonl(tmp_path / "chat.jsonl", [MULTI_TURN])
    with pytest.raises(
        DataError,
        match=r"chat.jsonl: line 1: the chat template of data.tokenizer=.*tok cannot give .* renders earlier turns",
    ):
        read_chat(path, "data.train_path", renderer, 1000)


def test_a_template_whose_prefix_tokenizes_differently_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The header "A:" and the answer "hi" are one word "A:hi" of the vocabulary: the prefix ends in "A:", the whole
    # conversation has "A:hi" there, so the prefix's ids are not a prefix of the conversation's.
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "Q:": 3, "A:": 4, "A:hi": 5, "hi": 6, "hello": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["</s>"]})
    fast.save_pretrained(str(tmp_path / "tok"))
    template = "{% for m in messages %}{% if m.role == 'user' %}Q: {{ m.content }} {% else %}A:{{ m.content }}</s>"
    template += "{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    (tmp_path / "tok" / "chat_template.jinja").write_text(template)
    renderer = chat_template(str(tmp_path / "tok"))
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": "hello", "response": "hi"}])
    with pytest.raises(DataError, match="does not tokenize as the start of the whole conversation"):
        read_chat(path, "data.train_path", renderer, 1000)
    # with a space between the header and the answer the same template is fine
    (tmp_path / "tok" / "chat_template.jinja").write_text(template.replace("A:", "A: "))
    data, _ = read_chat(path, "data.train_path", chat_template(str(tmp_path / "tok")), 1000)
    ids, mask = data.row(0)
    assert ids[mask].tolist() == [6, 2]


def test_a_template_that_raises_refuses_the_row_by_line(tmp_path):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}" + LLAMA3_LIKE
    renderer = chat_template(str(_bpe_folder(tmp_path / "tok", template)))
    path = _jsonl(tmp_path / "chat.jsonl", [PAIR, MULTI_TURN])
    with pytest.raises(DataError, match="chat.jsonl: line 2: the chat template .* refuses this conversation"):
        read_chat(path, "data.train_path", renderer, 1000)


def test_files_refused_whole(tmp_path):
    with pytest.raises(DataError, match="expected a .jsonl or .parquet file"):
        read_chat(tmp_path / "chat.csv", "data.train_path", chat_template("byte"), 10)
    with pytest.raises(DataError, match="no such file"):
        read_chat(tmp_path / "none.jsonl", "data.train_path", chat_template("byte"), 10)
    with pytest.raises(DataError, match="no rows"):
        read_chat(_jsonl(tmp_path / "empty.jsonl", [""]), "data.train_path", chat_template("byte"), 10)


def test_a_template_without_a_generation_prompt_is_refused(tmp_path):
    # without one the assistant's header would fall inside the mask: refused rather than learned
    template = LLAMA3_LIKE[: LLAMA3_LIKE.index("{% if add_generation_prompt %}")]
    renderer = chat_template(str(_bpe_folder(tmp_path / "tok", template)))
    path = _jsonl(tmp_path / "chat.jsonl", [PAIR])
    with pytest.raises(DataError, match="line 1: .* does not end its generation prompt where the assistant's content"):
        read_chat(path, "data.train_path", renderer, 1000)


# --- prompts for generate.py -------------------------------------------------------------------------------------
ASK = [{"role": "system", "content": "you are a helpful cat"}, {"role": "user", "content": "what is two plus two"}]


def test_template_prompt_ids_are_what_transformers_renders_with_the_generation_prompt(tmp_path):
    renderer = chat_template(str(_bpe_folder(tmp_path / "tok", LLAMA3_LIKE)))
    expected = renderer.tokenizer.apply_chat_template(ASK, tokenize=True, add_generation_prompt=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]  # (newer versions: a BatchEncoding)
    assert renderer.prompt_ids(ASK) == list(expected)
    # ... which is where a trained reply starts: the start of the conversation with the reply rendered
    answered = ASK + [{"role": "assistant", "content": "four"}]
    ids, mask = renderer.render(answered)
    assert ids[: len(renderer.prompt_ids(ASK))] == renderer.prompt_ids(ASK) and mask.index(True) == len(expected)


def test_template_end_of_turn_is_the_eos_token_and_the_templates_own(tmp_path):
    folder = _bpe_folder(tmp_path / "tok", LLAMA3_LIKE)
    eot = chat_template(str(folder)).tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert chat_template(str(folder)).end_of_turn_ids() == [eot]
    # A folder whose eos_token is another token (Llama 3's base <|end_of_text|>): both end a turn.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|begin_of_text|>"}))
    renderer = chat_template(str(folder))
    assert renderer.end_of_turn_ids() == [renderer.tokenizer.convert_tokens_to_ids("<|begin_of_text|>"), eot]


@pytest.mark.parametrize("spec", ["byte", "folder"])
def test_plain_prompt_ids_end_with_the_assistant_header_and_its_turn_with_the_eod(tmp_path, spec):
    renderer = chat_template(spec if spec == "byte" else str(_bpe_folder(tmp_path / "tok", None)))
    assert isinstance(renderer, PlainTemplate)
    prompt = renderer.prompt_ids(ASK)
    text = "<|system|>\nyou are a helpful cat\n<|user|>\nwhat is two plus two\n<|assistant|>\n"
    assert renderer.tokenizer.decode(prompt) == text
    ids, mask = renderer.render(ASK + [{"role": "assistant", "content": "four"}])
    assert ids[: len(prompt)] == prompt and mask.index(True) == len(prompt)
    assert renderer.end_of_turn_ids() == [renderer.tokenizer.eod] == [ids[-1]]


@pytest.mark.parametrize(
    "value, says",
    [
        (ASK + [{"role": "assistant", "content": "four"}], "message 3 (the last) is the assistant's"),
        ([{"role": "robot", "content": "hi"}], "message 1: role str 'robot'"),
        ([{"role": "user", "content": 7}], "message 1's content is int 7"),
        ([], "messages is list []"),
        ("hi", "messages is str 'hi'"),
    ],
)
def test_prompt_messages_refuse_what_a_model_cannot_answer(value, says):
    with pytest.raises(Refusal, match=re.escape(says)):
        prompt_messages(value)
    assert prompt_messages(ASK) == ASK


@pytest.mark.parametrize("spec", ["byte", "template"])
def test_prompt_text_is_what_prompt_ids_encode(tmp_path, spec):
    renderer = chat_template(spec if spec == "byte" else str(_bpe_folder(tmp_path / "tok", LLAMA3_LIKE)))
    messages = MULTI_TURN["messages"][:4]  # an earlier assistant turn among them
    text, ids = renderer.prompt_text(messages), renderer.prompt_ids(messages)
    if spec == "byte":  # the earlier turn's end-of-document id has no text
        assert ids.count(renderer.tokenizer.eod) == 1 and renderer.tokenizer.decode(ids) == text
    else:
        assert text == renderer.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert renderer.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids == ids
