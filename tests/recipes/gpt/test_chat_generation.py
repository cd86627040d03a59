"""generate.py with chat prompts: "messages" rows rendered as transformers renders them with the generation prompt,
a reply stopped at the template's end of turn, streamed text equal to the recorded text, rows refused by file and
line, a chat output continued; with a tiny GPT of random weights over a byte-level BPE with a Llama-3-like template."""

from __future__ import annotations

import json

import pytest
import torch

import generate
from core.config.errors import ConfigError, DataError
from core.layers.namespace import TORCH_LAYERS
from recipes.gpt.data import padded_vocab_size
from recipes.gpt.model import GPT
from recipes.gpt.recipe import GPTRecipe
from recipes.gpt.tokenizer import build_tokenizer
from tests.recipes.gpt.test_chat import LLAMA3_LIKE, _bpe_folder
from tests.recipes.gpt.test_inference import TINY_GPT
from tests.support.helpers import REPO, compose_config, run_python, validated_config

CHAT_GPT = [*TINY_GPT, "model.seq_length=128"]  # a context the chat prompts fit in
pytestmark = pytest.mark.slow  # a model made and a session started per test (seconds each)

ASK = [{"role": "system", "content": "you are a helpful cat"}, {"role": "user", "content": "what is two plus two"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(tokenizer folder, weights): the folder's eos_token <|begin_of_text|> (the end of document), so that its
    template's end of turn, <|eot_id|>, is a token of its own."""
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("chat_gen")
    folder = _bpe_folder(tmp / "tok", LLAMA3_LIKE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|begin_of_text|>"}))
    cfg = validated_config("gpt_sanity", CHAT_GPT + [f"data.tokenizer={folder}", "checkpoint.path=unused"])
    vocab = padded_vocab_size(build_tokenizer(str(folder)).vocab_size, cfg.model.make_vocab_size_divisible_by)
    torch.manual_seed(0)
    state = GPT(cfg.model, vocab, TORCH_LAYERS).state_dict()
    save_file(
        {k: v.contiguous() for k, v in state.items() if not k.endswith("_extra_state")}, str(tmp / "w.safetensors")
    )
    return folder, tmp / "w.safetensors"


def _settings(model, prompts, *overrides: str) -> list[str]:
    folder, weights = model
    return [
        *CHAT_GPT,
        f"data.tokenizer={folder}",
        f"checkpoint.init_from={weights}",
        f"generate.prompt_file={prompts}",
        "generate.greedy=true",
        "generate.max_new_tokens=12",
        f"checkpoint.path={prompts.parent}/unused",
        *overrides,
    ]


def _generate(model, tmp_path, rows, *overrides: str) -> list[generate.Generation]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return generate.generate(compose_config("gpt_sanity", _settings(model, prompts, *overrides)), tmp_path / "run")


def _template(model):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model[0]), local_files_only=True)


def test_messages_are_rendered_with_the_generation_prompt_and_the_stream_is_the_recorded_text(
    model, tmp_path, capsys, monkeypatch
):
    seen = []  # the tokens of each prompt's first forward pass (with the KV cache: the whole prompt)
    real = GPTRecipe.next_logits

    def spy(self, model_, tokens, kv_cache):
        if tokens.shape[1] > 1:  # a prefill
            seen.append(tokens[0].tolist())
        return real(self, model_, tokens, kv_cache)

    monkeypatch.setattr(GPTRecipe, "next_logits", spy)
    results = _generate(model, tmp_path, [{"messages": ASK}, {"prompt": "the cat sat"}])
    template = _template(model)
    rendered = template.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ids = template.apply_chat_template(ASK, tokenize=True, add_generation_prompt=True)
    assert seen[0] == list(ids if isinstance(ids, list) else ids["input_ids"])
    assert seen[1] == template.encode("the cat sat", add_special_tokens=False)
    saved = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert saved[0]["messages"] == ASK and saved[0]["prompt"] == rendered and "messages" not in saved[1]
    assert saved == [g.record() for g in results]
    out = capsys.readouterr().out
    for g in results:  # what was streamed, token by token, is the text recorded (random tokens: bytes of all kinds)
        assert f"--- prompt {results.index(g) + 1}\n{g.prompt}{g.text}\n--- ({g.stop}, {g.new_tokens} tokens)\n" in out
    assert any(ord(c) > 127 for g in results for c in g.text)  # (not only ASCII came out)


@pytest.mark.parametrize("forced", ["<|eot_id|>", "<|begin_of_text|>"])
def test_a_chat_reply_stops_at_the_end_of_turn_and_a_text_at_the_end_of_document(
    model, tmp_path, capsys, monkeypatch, forced
):
    """The model made to write `forced` as its 4th new token: a chat reply stops at either (the template's end of
    turn, or the folder's eos_token: the end of document), a text prompt at the end of document only."""
    stops = [_template(model).convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|begin_of_text|>")]
    forced_id = _template(model).convert_tokens_to_ids(forced)
    real, window = GPTRecipe.next_logits, {"start": 0, "last": 0}

    def forcing(self, model_, tokens, kv_cache):  # without a KV cache: each step sees the prompt and all new tokens
        length = tokens.shape[1]
        if length != window["last"] + 1:  # the first step of a prompt
            window["start"] = length
        window["last"] = length
        logits = real(self, model_, tokens, kv_cache)
        logits[0, -1, stops] = -1e4  # (random weights may write either)
        if length - window["start"] == 3:
            logits[0, -1, forced_id] = 1e4
        return logits

    monkeypatch.setattr(GPTRecipe, "next_logits", forcing)
    chat, text = _generate(model, tmp_path, [{"messages": ASK}, {"prompt": "the cat sat"}], "generate.kv_cache=false")
    assert (chat.stop, chat.new_tokens) == ("end_of_turn", 4)  # (the folder's eos_token ends a turn too)
    assert (text.stop, text.new_tokens) == (
        "length" if forced == "<|eot_id|>" else "eod",
        12 if forced == "<|eot_id|>" else 4,
    )
    out = capsys.readouterr().out
    assert f"{chat.prompt}{chat.text}\n--- ({chat.stop}, 4 tokens)\n" in out and forced not in chat.text


@pytest.mark.parametrize(
    "row, says",
    [
        ({"messages": ASK + [{"role": "assistant", "content": "four"}]}, "message 3 (the last) is the assistant's"),
        ({"messages": [{"role": "user"}]}, "no message 1's content"),
        ({"messages": "hi"}, "messages is str 'hi'"),
        ({"messages": ASK, "prompt": "hi"}, 'expected a JSON object with a "prompt" string or a "messages" list'),
        ({"text": "hi"}, 'expected a JSON object with a "prompt" string or a "messages" list'),
    ],
)
def test_a_row_a_model_cannot_answer_is_refused_by_file_and_line(model, tmp_path, row, says):
    with pytest.raises(DataError) as refused:
        _generate(model, tmp_path, [{"messages": ASK}, row])
    assert str(refused.value).startswith(f"generate.prompt_file={tmp_path}/prompts.jsonl: line 2: ")
    assert says in str(refused.value)
    assert not (tmp_path / "run" / "generations.jsonl").exists()  # refused before any work


def test_text_prompts_as_chats_and_a_chat_output_continued(model, tmp_path):
    """generate.chat=true: a .txt line is the user's message; the same command continues its output after a
    torn line, to the uninterrupted run's bytes."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("what is two plus two\nwhere is the cat\n")
    settings = _settings(model, prompts, "generate.chat=true", f"generate.output={tmp_path}/chat.jsonl")
    whole = generate.generate(compose_config("gpt_sanity", settings), tmp_path / "a")
    assert [g.messages for g in whole] == [
        [{"role": "user", "content": line}] for line in prompts.read_text().split("\n")[:2]
    ]
    assert whole[0].prompt == _template(model).apply_chat_template(
        whole[0].messages, tokenize=False, add_generation_prompt=True
    )
    reference = (tmp_path / "chat.jsonl").read_bytes()
    (tmp_path / "chat.jsonl").write_bytes(reference[: reference.index(b"\n") + 10])  # record 2 torn
    assert len(generate.generate(compose_config("gpt_sanity", settings), tmp_path / "b")) == 1
    assert (tmp_path / "chat.jsonl").read_bytes() == reference
    # The same texts as plain prompts are other prompts: that output is not theirs.
    with pytest.raises(ConfigError, match="the prompts .* 2 there, 2 now, not the same"):
        generate.generate(compose_config("gpt_sanity", settings[:-2] + settings[-1:]), tmp_path / "c")


def test_generate_command_streams_a_chat_reply(model, tmp_path):
    """python generate.py as a user runs it, on a messages row: the reply streamed between the rendered prompt and
    the line saying why it stopped, as recorded."""
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text(json.dumps({"messages": ASK}) + "\n")
    proc = run_python(
        REPO / "generate.py",
        "--config-name",
        "gpt_sanity",
        *_settings(model, prompts),
        f"hydra.run.dir={tmp_path}/run",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert record["messages"] == ASK and record["stop"] in ("length", "end_of_turn")
    assert (
        f"--- prompt 1\n{record['prompt']}{record['text']}\n--- ({record['stop']}, {record['new_tokens']} tokens)\n"
        in proc.stdout
    )
