"""Document offsets of a packed GPT row (recipes/gpt/packing.py): row_offsets' layout and refusals, and the
documents of a pretraining sample split after each end-of-document token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipes.gpt.packing import eod_document_count, eod_document_lengths, row_offsets


def test_row_offsets_documents_then_padding_then_empty_slots():
    offsets = row_offsets([3, 5, 2], budget=16, slots=6)
    assert offsets.dtype == np.int32
    assert offsets.tolist() == [0, 3, 8, 10, 16, 16, 16]  # 3 documents, the padding piece, 2 empty slots


def test_row_offsets_full_row_and_no_documents():
    # no padding: the padding's slot is an empty piece like the unused ones
    assert row_offsets([4, 4], budget=8, slots=3).tolist() == [0, 4, 8, 8]
    assert row_offsets([], budget=8, slots=2).tolist() == [0, 8, 8]  # all padding


@pytest.mark.parametrize(
    "lengths, budget, slots, message",
    [
        ([1, 1, 1], 8, 3, "need 4 slots"),  # the padding needs a slot of its own
        ([5, 4], 8, 4, "9 tokens do not fit a row of 8"),
        ([2, -1], 8, 4, "expected each >= 0"),
    ],
)
def test_row_offsets_refuses_what_does_not_fit(lengths, budget, slots, message):
    with pytest.raises(ValueError, match=message):
        row_offsets(lengths, budget, slots)


EOD = 9


def test_documents_end_after_each_end_of_document_token():
    tokens = np.array([1, 2, EOD, 3, EOD, 4, 5, 6])
    assert eod_document_lengths(tokens, EOD, max_documents=8) == [3, 2, 3]
    assert eod_document_count(tokens, EOD) == 3


def test_an_end_of_document_last_starts_no_document():
    tokens = np.array([EOD, 1, 2, EOD])  # a sample starting just after a document's end: its first token is one
    assert eod_document_lengths(tokens, EOD, max_documents=8) == [1, 3]
    assert eod_document_count(tokens, EOD) == 2
    assert eod_document_lengths(np.array([1, 2, 3]), EOD, max_documents=1) == [3]
    assert eod_document_lengths(np.array([], dtype=np.int64), EOD, max_documents=4) == []
    assert eod_document_count(np.array([], dtype=np.int64), EOD) == 0


def test_documents_beyond_the_maximum_share_the_final_span():
    tokens = np.array([EOD, EOD, 1, EOD, 2, EOD, 3, 4])  # 5 documents: [1, 1, 2, 2, 2]
    assert eod_document_lengths(tokens, EOD, max_documents=5) == [1, 1, 2, 2, 2]
    assert eod_document_lengths(tokens, EOD, max_documents=3) == [1, 1, 6]
    assert eod_document_lengths(tokens, EOD, max_documents=1) == [8]
    assert eod_document_count(tokens, EOD) == 5
    with pytest.raises(ValueError, match="max_documents=0"):
        eod_document_lengths(tokens, EOD, max_documents=0)


def test_a_sample_packs_into_its_row():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, EOD + 1, size=64)
    lengths = eod_document_lengths(tokens, EOD, max_documents=4)
    offsets = row_offsets(lengths, budget=64, slots=5)
    assert sum(lengths) == 64 and offsets[-1] == 64 and np.all(np.diff(offsets) >= 0)
    # every boundary but the merged last span's is just after an end-of-document token
    assert all(tokens[o - 1] == EOD for o in offsets[1 : len(lengths)])


# The model on packed rows (the plain-torch twins, fp32): each document as if it were alone.

S, SLOTS, VOCAB = 16, 5, 48


def _tiny_gpt():
    from core.layers.namespace import TORCH_LAYERS
    from recipes.gpt.config import GPTModelConfig
    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    cfg = GPTModelConfig(
        seq_length=S, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64
    )
    model = GPT(cfg, VOCAB, TORCH_LAYERS)
    with torch.no_grad():  # sharp attention: a leak between documents, or a position off, shows in the logits
        for block in model.layers:
            block.self_attention.layernorm_qkv.weight.mul_(10)
    return model


# row 0: three documents filling it; row 1: two documents, the padding, empty slots
DOCUMENTS = [[5, 3, 8], [7, 2]]


def _packed_batch():
    tokens = torch.randint(0, VOCAB, (len(DOCUMENTS), S), generator=torch.Generator().manual_seed(1))
    cu = torch.from_numpy(np.stack([row_offsets(lengths, S, SLOTS) for lengths in DOCUMENTS]))
    return tokens, cu


def _spans():
    for r, lengths in enumerate(DOCUMENTS):
        start = 0
        for n in lengths:
            yield r, start, n
            start += n


def test_packed_documents_equal_each_document_alone():
    model = _tiny_gpt()
    tokens, cu = _packed_batch()
    packed = model(tokens, cu_seqlens=cu)
    assert packed.shape == (2, S, VOCAB)
    for r, start, n in _spans():
        torch.testing.assert_close(packed[r, start : start + n], model(tokens[r : r + 1, start : start + n])[0])
    # the padding's tokens change nothing in the documents
    other = tokens.clone()
    other[1, 9:] = (other[1, 9:] + 1) % VOCAB
    torch.testing.assert_close(model(other, cu_seqlens=cu)[1, :9], packed[1, :9])
    # the same document at a row's start and after another gives the same logits
    moved = tokens.clone()
    moved[0, 5:8] = tokens[0, :3]
    out = model(moved, cu_seqlens=cu)
    torch.testing.assert_close(out[0, 5:8], model(tokens[:1, :3])[0])
    # without document masks the second document sees the first (the test's model is sharp enough to tell)
    assert not torch.allclose(model(tokens)[0, 5:8], packed[0, 5:8], atol=1e-3)


def test_plain_rows_run_as_before_after_packed_ones():
    model = _tiny_gpt()
    tokens, cu = _packed_batch()
    before = model(tokens)
    model(tokens, cu_seqlens=cu)
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected \\[rows, slots \\+ 1\\]"):
        model(tokens, cu_seqlens=cu[0])


def test_packed_loss_and_gradients_equal_the_documents_alone():
    model = _tiny_gpt()
    tokens, cu = _packed_batch()
    labels = torch.roll(tokens, -1, dims=1)
    real = torch.zeros(2, S)
    real[0, :], real[1, :9] = 1.0, 1.0  # row 1's padding carries no loss
    (model(tokens, labels=labels, cu_seqlens=cu) * real).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 for g in packed.values())  # every weight learns from packed rows
    model.zero_grad()
    for r, start, n in _spans():
        end = start + n
        model(tokens[r : r + 1, start:end], labels=labels[r : r + 1, start:end]).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, msg=name)


def test_rotary_positions_restart_at_each_document(monkeypatch):
    """RoPE's attention depends on position differences only, so a document's logits cannot show where its
    positions start: the angles the blocks are given are checked instead."""
    from core.layers import torch_twins

    model = _tiny_gpt()
    tokens, cu = _packed_batch()
    seen, rotate = [], torch_twins.apply_rotary_pos_emb
    monkeypatch.setattr(torch_twins, "apply_rotary_pos_emb", lambda t, freqs: seen.append(freqs) or rotate(t, freqs))
    model(tokens, cu_seqlens=cu)
    table = model.rotary(S)
    expected = [p for lengths in DOCUMENTS for n in [*lengths, S - sum(lengths)] for p in range(n)]
    assert len(seen) == 2 * 2  # queries and keys of each block
    for freqs in seen:
        torch.testing.assert_close(freqs, table[expected], rtol=0, atol=0)


# Pretraining with data.packing: the Megatron samples' document offsets, the recipe's forward and work.


def _packed_recipe(tmp_path, *overrides):
    from recipes.gpt.recipe import GPTRecipe
    from tests.support.helpers import validated_config

    return GPTRecipe(
        validated_config(
            "gpt_sanity",
            [
                "checkpoint.path=unused",
                f"data.cache_dir={tmp_path}/cache",
                "training.steps=2",
                "data.packing=true",
                "model.seq_length=64",
                *overrides,
            ],
        )
    )


def test_a_pretraining_sample_gets_its_document_offsets_and_shared_spans_are_told(caplog):
    from recipes.gpt.data import DocumentOffsets

    offsets = DocumentOffsets(EOD, max_documents=2)
    cu = offsets(torch.tensor([1, EOD, 2, 3, EOD, 4, 5, 6]), idx=0)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 8, 8]  # two documents fill the sample: no padding
    assert offsets.merged == 1  # the last two documents share the span 2:8
    caplog.clear()
    with caplog.at_level("WARNING", logger="recipes.gpt.data"):
        for idx in range(1, 6):
            offsets(torch.tensor([EOD, EOD, EOD, 1]), idx)
        offsets(torch.tensor([1, 2, EOD, 3]), 6)  # two documents: kept apart, not counted
    assert offsets.merged == 6
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2 and "sample 1 holds 4 documents" in told[0] and "its last 3 share one span" in told[0]
    assert "sample 3" in told[1] and "4 such samples in this process" in told[1]  # at the 1st, 2nd, 4th, ...: 2, 4


def test_the_recipe_runs_packed_rows_and_counts_their_real_tokens(tmp_path):
    from core.layers.namespace import TORCH_LAYERS

    recipe = _packed_recipe(tmp_path, "data.max_documents_per_sample=3", "model.num_layers=1")
    model = recipe.build_model(TORCH_LAYERS, torch.device("cpu"))
    rng = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 65), generator=rng)
    cu = torch.from_numpy(np.stack([row_offsets([20, 30, 14], 64, 4), row_offsets([64], 64, 4)]))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 64), "cu_seqlens": cu}
    out = recipe.forward(model, batch, training=True)
    packed = model(batch["tokens"], labels=batch["labels"], cu_seqlens=cu).sum(1)
    torch.testing.assert_close(out["loss"], packed)
    assert not torch.allclose(out["loss"][0], model(batch["tokens"], labels=batch["labels"]).sum(1)[0])
    m, n = recipe.cfg.model, recipe.non_embedding_parameters()
    tokens, flops = recipe.work(batch)
    assert tokens == 2 * 64  # pretraining samples are documents throughout
    assert flops == 6.0 * n * 128 + 12.0 * m.num_layers * m.hidden_size * (20**2 + 30**2 + 14**2 + 64**2)
    # rows with padding name their documents: the pieces after them are not counted
    padded = dict(batch, cu_seqlens=torch.from_numpy(np.stack([row_offsets([10], 64, 4), row_offsets([64], 64, 4)])))
    tokens, flops = recipe.work(dict(padded, documents=torch.tensor([1, 1])))
    assert tokens == 10 + 64 and flops == 6.0 * n * 74 + 12.0 * m.num_layers * m.hidden_size * (10**2 + 64**2)
    unpacked = {k: v for k, v in batch.items() if k != "cu_seqlens"}
    assert recipe.work(unpacked) is None  # unpacked pretraining samples: seq_length tokens each
    tokens, flops = recipe.work(dict(unpacked, real_tokens=torch.tensor([10, 64])))  # SFT rows, one padded chat each
    assert tokens == 10 + 64 and flops == 6.0 * n * 74 + 12.0 * m.num_layers * m.hidden_size * (10**2 + 64**2)


def test_max_documents_per_sample_is_checked(tmp_path):
    from core.config.errors import ConfigError

    with pytest.raises(ConfigError, match="max_documents_per_sample=65 with model.seq_length=64"):
        _packed_recipe(tmp_path, "data.max_documents_per_sample=65")
    with pytest.raises(ConfigError, match="max_documents_per_sample"):
        _packed_recipe(tmp_path, "data.max_documents_per_sample=0")


@pytest.mark.slow
def test_pretraining_with_packing_on_two_processes(tmp_path):
    from tests.support.helpers import REPO, read_records, run_python_ranks

    proc = run_python_ranks(
        2,
        REPO / "train.py",
        "--config-name",
        "gpt_sanity",
        "data.packing=true",
        "data.max_documents_per_sample=2",
        "model.seq_length=64",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.ffn_hidden_size=64",
        "training.steps=4",
        "training.micro_batch_size=4",
        "training.global_batch_size=16",
        "training.val_every_n_steps=4",
        "training.limit_val_batches=2",
        "training.log_every_n_steps=2",
        "data.num_workers=0",
        "logger.progress_bar=never",
        f"data.cache_dir={tmp_path}/cache",
        f"hydra.run.dir={tmp_path}/run",
        f"checkpoint.path={tmp_path}/ckpt",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "more than data.max_documents_per_sample=2" in proc.stdout + proc.stderr
    rows = read_records(tmp_path / "run")
    train = [r for r in rows if "split" not in r]
    (val,) = [r for r in rows if r.get("split") == "val"]
    assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train) and np.isfinite(val["loss"])
    # real tokens from Recipe.work: a pretraining sample is documents throughout
    assert train[-1]["tokens_per_sec_per_gpu"] == pytest.approx(train[-1]["samples_per_sec_per_gpu"] * 64, rel=1e-6)
