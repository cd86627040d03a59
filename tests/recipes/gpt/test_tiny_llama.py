"""data/tiny_llama (scripts/make_tiny_llama.py): rebuilt byte for byte by its script, loaded by transformers offline,
its chat template rendered into a loss mask on exactly the responses by recipes/gpt/chat.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from recipes.gpt.chat import HFChatTemplate, chat_template, read_chat

REPO = Path(__file__).resolve().parents[3]
FOLDER = REPO / "data/tiny_llama"
SCRIPT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
CONVERSATIONS = [
    {"prompt": "What is 17 + 25?", "response": "17 + 25 = 42."},
    {
        "messages": [
            {"role": "system", "content": "You reverse words."},
            {"role": "user", "content": "Reverse: cat"},
            {"role": "assistant", "content": "tac"},
            {"role": "user", "content": "And dog?\n"},
            {"role": "assistant", "content": "  god  "},
        ]
    },
    {"messages": [{"role": "user", "content": "Say 7 twice."}, {"role": "assistant", "content": "7 7"}]},
]


def _script():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_tiny_llama
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return make_tiny_llama


@pytest.mark.slow
def test_the_shipped_folder_is_what_the_script_makes(tmp_path):
    """Its README's command rebuilds the script's files byte for byte; the folder stays small."""
    command = (FOLDER / "README.md").read_text().split("python scripts/make_tiny_llama.py", 1)[1].splitlines()[0]
    args = command.split()
    _script().main(args + ["--out", str(tmp_path)])
    for name in SCRIPT_FILES:
        assert (tmp_path / name).read_bytes() == (FOLDER / name).read_bytes(), name
    assert sum(f.stat().st_size for f in FOLDER.iterdir()) < 1 << 20


def test_transformers_loads_it_offline_and_renders_the_llama3_template(monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(str(FOLDER), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(FOLDER), local_files_only=True)
    messages = CONVERSATIONS[1]["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou reverse words.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nReverse: cat<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\ntac<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd dog?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\ngod<|eot_id|>"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.decode([tokenizer.eos_token_id]) == "<|eot_id|>"
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["vocab_size"] % 128 == 0 and config["vocab_size"] > max(tokenizer.get_vocab().values())
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()


def test_its_chat_template_gives_a_loss_mask_on_exactly_the_responses(tmp_path):
    """chat.py's prefix checks accept the template, and the masked tokens decode to each response (trimmed, as the
    template trims it) and its <|eot_id|>, nothing else."""
    from tokenizers import Tokenizer

    renderer = chat_template(str(FOLDER))
    assert isinstance(renderer, HFChatTemplate)
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    data, summary = read_chat(rows, "data.train_path", renderer, 1000)
    assert (summary.kept, summary.dropped, summary.truncated) == (3, 0, 0)
    tokenizer = Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|eot_id|>")
    for i, row in enumerate(CONVERSATIONS):
        ids, mask = data.row(i)
        responses = (
            [row["response"]]
            if "response" in row
            else [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        )
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
        runs = list(zip(edges[::2], edges[1::2]))
        assert len(runs) == len(responses)
        for (start, end), response in zip(runs, responses):
            assert ids[end - 1] == eot
            assert tokenizer.decode(ids[start : end - 1].tolist(), skip_special_tokens=False) == response.strip()


def test_the_shipped_chat_set_renders_whole():
    """Every row of data/chat_sanity's validation set passes the template's prefix checks (none refused)."""
    data, summary = read_chat(REPO / "data/chat_sanity/val.jsonl", "data.val_path", chat_template(str(FOLDER)), 4096)
    assert summary.kept == summary.rows_read > 0 and 0 < summary.response_tokens < summary.tokens
