"""data.format=chat: conversations -> the GPT recipe's rows (recipes/gpt/sft_data.py), packed or padded, with the
loss on exactly the response tokens; the config's checks; the recipe's datasets and the shipped configs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from core.config.errors import ConfigError
from core.data.checks import assert_dataset_deterministic
from recipes.gpt.chat import PlainTemplate, read_chat
from recipes.gpt.sft_data import ChatRows
from recipes.gpt.tokenizer import ByteTokenizer
from tests.support.helpers import REPO, validated_config

BYTE = ByteTokenizer()
ROWS = [
    {"prompt": "hi", "response": "ok"},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"},
        ]
    },
    {"prompt": "name a colour", "response": "blue"},
    {"prompt": "reverse abc", "response": "cba"},
]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _chats(tmp_path, rows=ROWS, max_length=100, too_long="truncate"):
    return read_chat(
        _jsonl(tmp_path / "chat.jsonl", rows), "data.train_path", PlainTemplate(BYTE), max_length, too_long
    )


def test_a_padded_row_shifts_within_its_conversation_and_scores_exactly_the_response(tmp_path):
    chats, _ = _chats(tmp_path)
    rows = ChatRows(chats, seq_length=100, pad=BYTE.eod, max_documents=None, shuffle_seed=None)
    assert len(rows) == len(ROWS)
    row = rows[0]
    whole = _ids("<|user|>\nhi\n<|assistant|>\nok") + [BYTE.eod]
    n = len(whole) - 1
    assert set(row) == {"tokens", "labels", "loss_mask", "idx", "real_tokens"} and row["idx"] == 0
    assert row["real_tokens"] == n  # what Recipe.work counts for a padded row
    assert row["tokens"].dtype == row["labels"].dtype == torch.int64 and row["loss_mask"].dtype == torch.float32
    assert row["tokens"][:n].tolist() == whole[:-1] and row["labels"][:n].tolist() == whole[1:]
    assert row["tokens"][n:].eq(BYTE.eod).all() and row["labels"][n:].eq(0).all()
    # the positions scored are those predicting "ok" and the end of turn, nothing of the prompt or the padding
    assert row["labels"][row["loss_mask"].bool()].tolist() == _ids("ok") + [BYTE.eod]
    assert row["loss_mask"].nonzero().flatten().tolist() == list(range(n - 3, n))
    two_turns = rows[1]
    assert BYTE.decode(two_turns["labels"][two_turns["loss_mask"].bool()].tolist()) == "46"
    assert two_turns["labels"][two_turns["loss_mask"].bool()].eq(BYTE.eod).sum() == 2  # each turn's end


def test_packed_rows_hold_the_padded_rows_conversations_each_once_within_budget_and_slots(tmp_path):
    rows = [*ROWS] * 10
    chats, _ = _chats(tmp_path, rows)
    padded = ChatRows(chats, seq_length=200, pad=BYTE.eod, max_documents=None, shuffle_seed=None)
    packed = ChatRows(chats, seq_length=200, pad=BYTE.eod, max_documents=3, shuffle_seed=5)
    assert len(packed) < len(padded) / 2
    seen = []
    for k in range(len(packed)):
        row = packed[k]
        members = packed.conversations(k)
        offsets = row["cu_seqlens"].tolist()
        assert (
            len(offsets) == 3 + 2 and offsets[0] == 0 and offsets[-1] == 200 and row["documents"] == len(members) <= 3
        )
        for i, (a, b) in zip(members, zip(offsets, offsets[1:])):
            alone = padded[i]
            n = b - a
            assert n == chats.offsets[i + 1] - chats.offsets[i] - 1
            for key in ("tokens", "labels", "loss_mask"):
                assert torch.equal(row[key][a:b], alone[key][:n]), (k, i, key)
        end = offsets[len(members)]
        assert row["loss_mask"][end:].eq(0).all() and row["tokens"][end:].eq(BYTE.eod).all()
        seen += members
    assert sorted(seen) == list(range(len(chats)))
    assert seen != sorted(seen)  # the training split's plan is shuffled (seeded)
    assert (
        packed.real_tokens
        == padded.real_tokens
        == sum(int(r["loss_mask"].numel()) for r in [])
        + sum(int(chats.offsets[i + 1] - chats.offsets[i] - 1) for i in range(len(chats)))
    )


def test_packed_conversations_padded_to_a_multiple_keep_their_tokens_and_score_no_padding(tmp_path):
    """multiple=4 (2 x cp for context parallelism, which cuts every document of a packed row into 2 x cp equal
    chunks): each conversation's slot is its positions then padding up to a multiple of 4, and the row's last
    piece too; the conversation's tokens, labels and loss mask are the padded row's, the padding scores nothing."""
    rows = [*ROWS] * 10
    chats, _ = _chats(tmp_path, rows)
    padded = ChatRows(chats, seq_length=200, pad=BYTE.eod, max_documents=None, shuffle_seed=None)
    packed = ChatRows(chats, seq_length=200, pad=BYTE.eod, max_documents=3, shuffle_seed=5, multiple=4)
    lengths = [int(chats.offsets[i + 1] - chats.offsets[i] - 1) for i in range(len(chats))]
    assert any(n % 4 for n in lengths)  # some conversations do need padding
    seen = []
    for k in range(len(packed)):
        row, members = packed[k], packed.conversations(k)
        offsets = row["cu_seqlens"].tolist()
        assert all((b - a) % 4 == 0 for a, b in zip(offsets, offsets[1:])) and offsets[-1] == 200
        for i, a, b in zip(members, offsets, offsets[1:]):
            n = lengths[i]
            assert b - a == -(-n // 4) * 4
            for key in ("tokens", "labels", "loss_mask"):
                assert torch.equal(row[key][a : a + n], padded[i][key][:n]), (k, i, key)
            assert row["loss_mask"][a + n : b].eq(0).all() and row["tokens"][a + n : b].eq(BYTE.eod).all()
        # what Recipe.work counts: each conversation's positions, not its padding (0 for the row's last piece)
        assert row["seqlens"].tolist() == [lengths[i] for i in members] + [0] * (4 - len(members))
        seen += members
    assert sorted(seen) == list(range(len(chats)))
    assert packed.real_tokens == padded.real_tokens == sum(lengths)
    assert "seqlens" not in ChatRows(chats, seq_length=200, pad=BYTE.eod, max_documents=3, shuffle_seed=5)[0]
    with pytest.raises(ValueError, match="multiple=4"):
        ChatRows(chats, seq_length=200, pad=BYTE.eod, max_documents=None, shuffle_seed=None, multiple=4)
    with pytest.raises(ValueError, match="multiples of 256"):  # a conversation's slot would exceed the row
        ChatRows(chats, seq_length=200, pad=BYTE.eod, max_documents=3, shuffle_seed=5, multiple=256)


def test_rows_are_the_same_on_every_call_and_build_and_the_plan_follows_the_seed(tmp_path):
    chats, _ = _chats(tmp_path, [*ROWS] * 10)
    a = ChatRows(chats, seq_length=100, pad=BYTE.eod, max_documents=3, shuffle_seed=5)
    b = ChatRows(chats, seq_length=100, pad=BYTE.eod, max_documents=3, shuffle_seed=5)
    assert_dataset_deterministic(a, indices=range(len(a)))
    for k in range(len(a)):
        assert all(torch.equal(a[k][key], b[k][key]) for key in ("tokens", "labels", "loss_mask", "cu_seqlens"))
    other = ChatRows(chats, seq_length=100, pad=BYTE.eod, max_documents=3, shuffle_seed=6)
    assert [other.conversations(k) for k in range(len(other))] != [a.conversations(k) for k in range(len(a))]


def test_too_long_conversations_are_truncated_or_dropped_and_counted(tmp_path):
    longest = max(len(PlainTemplate(BYTE).render(chat_messages(r))[0]) for r in ROWS)
    chats, summary = _chats(tmp_path, max_length=30)
    assert summary.truncated + summary.dropped > 0 and summary.kept + summary.dropped == len(ROWS) and longest > 30
    rows = ChatRows(chats, seq_length=30, pad=BYTE.eod, max_documents=4, shuffle_seed=1)
    assert all(rows[k]["tokens"].shape == (30,) for k in range(len(rows)))
    _, dropped = _chats(tmp_path, max_length=30, too_long="drop")
    assert dropped.truncated == 0 and dropped.dropped == summary.truncated + summary.dropped


def chat_messages(row: dict) -> list[dict]:
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def _recipe(tmp_path, *overrides):
    from recipes.gpt.recipe import GPTRecipe

    return GPTRecipe(
        validated_config(
            "gpt_sft_sanity",
            [
                "checkpoint.path=unused",
                "checkpoint.init_from=null",
                "data.tokenizer=byte",
                f"data.train_path={_jsonl(tmp_path / 'train.jsonl', [*ROWS] * 5)}",
                f"data.val_path={_jsonl(tmp_path / 'val.jsonl', ROWS)}",
                *overrides,
            ],
        )
    )


def test_the_recipe_builds_chat_rows_logs_each_split_once_and_counts_response_tokens(tmp_path, caplog):
    recipe = _recipe(tmp_path, "model.vocab_size=null", "model.seq_length=128")
    with caplog.at_level(logging.INFO, logger="recipes.gpt.sft_data"):
        datasets = recipe.build_datasets()
    lines = [r.getMessage() for r in caplog.records if r.name == "recipes.gpt.sft_data"]
    assert len(lines) == 2 and "data.train_path=" in lines[0] and "data.val_path=" in lines[1]
    assert "20 rows read, 20 kept (0 truncated to 129 tokens)" in lines[0] and "response tokens" in lines[0]
    assert recipe.vocab_size == 384  # the byte tokenizer's 258 ids, padded to a multiple of 128
    assert "cu_seqlens" in datasets.train[0] and "cu_seqlens" in datasets.val[0]
    # the validation rows are in file order: the first holds the file's first conversations
    assert datasets.val.conversations(0)[:2] == [0, 1]
    padded = _recipe(tmp_path, "model.vocab_size=null", "model.seq_length=128", "data.packing=false").build_datasets()
    assert "cu_seqlens" not in padded.train[0] and len(padded.train) == 20


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.train_path=null"], "data.format=chat needs data.train_path"),
        (["data.format=text", "data.text_files=[a.txt]"], r"data.train_path=.*: only data.format=chat reads it"),
    ],
)
def test_the_chat_keys_are_checked_by_name(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _recipe(tmp_path, *overrides)


def test_the_shipped_sft_configs_compose_with_the_shapes_they_name():
    from tests.support.helpers import compose_config

    sanity = validated_config("gpt_sft_sanity", ["checkpoint.path=unused"])
    assert sanity.data.format == "chat" and sanity.data.packing and sanity.model.hidden_size == 64
    assert Path(sanity.checkpoint.init_from) == REPO / "data" / "tiny_llama" == Path(sanity.data.tokenizer)
    assert Path(sanity.data.train_path).is_file() and Path(sanity.data.val_path).is_file()
    big = compose_config(
        "llama_sft", ["checkpoint.init_from=/models/x", "data.tokenizer=/models/x", "data.train_path=chats.jsonl"]
    )
    assert big.data.tokenizer == "/models/x" and big.model.num_query_groups == 8 and big.model.seq_length == 4096
    assert big.precision.param_dtype == "bf16" and big.distributed.mfsdp.zero_dp_strategy == 3


def test_flops_count_what_finetune_mode_trains():
    """MFU's FLOPs: full 6 N per token; LoRA 4 N (no weight gradients for frozen weights) + 6 per adapter parameter,
    counted from the model's own adapters; frozen with the output projection as the head: 2 N + its weight gradient."""
    from core.layers.namespace import TORCH_LAYERS
    from core.training import finetune
    from recipes.registry import get_recipe

    def recipe(*overrides):
        cfg = validated_config("gpt_sft_sanity", ["checkpoint.path=unused", "checkpoint.init_from=null", *overrides])
        return get_recipe("gpt")(cfg)

    full = recipe()
    n = full.non_embedding_parameters()
    assert full.flops_per_token() == 6.0 * n
    lora = recipe("finetune.mode=lora", "finetune.lora.target_modules=[layernorm_qkv,proj,output_layer]")
    model = lora.build_model(TORCH_LAYERS, torch.device("cpu"))
    finetune.apply(model, lora.cfg.finetune, 0, None)
    adapters = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    assert lora.flops_per_token() == 4.0 * n + 6.0 * adapters
    frozen = recipe("finetune.mode=frozen", "finetune.head=[output_layer]")
    assert frozen.flops_per_token() == 2.0 * n + 2.0 * frozen.vocab_size * frozen.cfg.model.hidden_size


def test_a_conversation_of_seq_length_plus_one_tokens_fills_a_row_whole(tmp_path):
    # n tokens make n - 1 positions: the row keeps the conversation's last token, its end of turn, as a label
    shortest = min(ROWS, key=lambda r: len(PlainTemplate(BYTE).render(chat_messages(r))[0]))
    n = len(PlainTemplate(BYTE).render(chat_messages(shortest))[0])
    rows = _recipe(tmp_path, "model.vocab_size=null", f"model.seq_length={n - 1}", "data.too_long=drop")
    row = rows.build_datasets().train[0]
    assert row["labels"][-1].item() == BYTE.eod and row["loss_mask"][-1].item() == 1.0
