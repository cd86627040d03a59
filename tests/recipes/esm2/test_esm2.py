"""The ESM-2 recipe: its vocabulary, sequence files, masking, packing, and the model against Hugging Face's
EsmForMaskedLM (in float64/float32 on the plain-torch layers)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from core.config.errors import ConfigError
from core.data.datasets import EpochIndex, sample_generator
from core.data.pack_planning import plan_packs
from core.layers.namespace import TORCH_LAYERS
from recipes.esm2 import hf as esm_hf
from recipes.esm2.masking import IGNORE, Masking, crop_and_mask
from recipes.esm2.model import ESM2, MASK_RATIO_TRAIN, VOCAB_SIZE
from recipes.esm2.packing import PackedSequences
from recipes.esm2.sequences import build_store, read_store, write_store
from recipes.esm2.sources import records
from recipes.esm2.tokenizer import CLS, EOS, MASK, PAD, SPECIAL, VOCABULARY, decode, encode_residues

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "data" / "uniref90_sample" / "uniref90_1000.parquet"


def model_config(**changes):
    cfg = dict(
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=64,
        max_seq_length=40,
        activation="gelu_erf",
        token_dropout=True,
        rotary_base=10000.0,
        norm_epsilon=1e-5,
        init_std=0.02,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        fuse_qkv_params=True,
    )
    return SimpleNamespace(**(cfg | changes))


def small_store(n=30, seed=0, longest=60):
    rng = np.random.default_rng(seed)
    letters = np.array(list("LAGVSERTIDPKQNFYMHWC"))
    return build_store(
        ((f"s{i}", "".join(rng.choice(letters, int(rng.integers(1, longest))))) for i in range(n)), "test"
    )


# --- vocabulary ---------------------------------------------------------------------------------
def test_vocabulary_is_hugging_faces_esm2_vocabulary():
    from transformers.models.esm.configuration_esm import get_default_vocab_list

    assert list(VOCABULARY) == list(get_default_vocab_list())
    assert (VOCABULARY[CLS], VOCABULARY[PAD], VOCABULARY[EOS], VOCABULARY[MASK]) == (
        "<cls>",
        "<pad>",
        "<eos>",
        "<mask>",
    )
    assert encode_residues("MKtay\nIAK").tolist() == [20, 15, 11, 5, 19, 12, 5, 15]  # HF: "MKTAYIAK" -> 20 15 11 ...
    assert decode(encode_residues("J*é")) == "<unk><unk><unk>"


# --- sequence files -----------------------------------------------------------------------------
def write_sources(folder: Path, named: list[tuple[str, str]]) -> dict[str, Path]:
    """The same sequences as FASTA (plain and gzipped), parquet, CSV, TSV and a `datasets` save_to_disk folder."""
    fasta = "".join(f">{n} some description\n{s[:7]}\n{s[7:]}\n\n" for n, s in named)
    paths = {
        "fasta": folder / "a.fasta",
        "fasta.gz": folder / "b.fa.gz",
        "parquet": folder / "c.parquet",
        "csv": folder / "d.csv",
        "tsv": folder / "e.tsv",
        "datasets": folder / "saved",
    }
    paths["fasta"].write_text("; a comment line\n" + fasta)
    with gzip.open(paths["fasta.gz"], "wt") as f:
        f.write(fasta)
    table = pa.table({"id": [n for n, _ in named], "sequence": [s for _, s in named]})
    pq.write_table(table, paths["parquet"])
    paths["csv"].write_text("id,sequence\n" + "".join(f"{n},{s}\n" for n, s in named))
    paths["tsv"].write_text("id\tsequence\n" + "".join(f"{n}\t{s}\n" for n, s in named))
    saved = paths["datasets"]
    saved.mkdir()
    with pa.ipc.new_stream(saved / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return paths


def test_every_source_format_gives_the_same_sequences(tmp_path):
    named = [(f"p{i}", "MKTAYIAKQRQISFVKSHFSRQ"[i:] + "LAGV" * i) for i in range(6)]
    for kind, path in write_sources(tmp_path, named).items():
        store = read_store(path)
        assert len(store) == 6, kind
        assert [decode(store.sequence(i)) for i in range(6)] == [s for _, s in named], kind
        assert [store.name(i) for i in range(6)] == [n for n, _ in named], kind
    # A folder reads each file in name order (here: the FASTA files and the tables, 5 x 6 sequences).
    assert len(read_store(tmp_path)) == 30 + 6  # the datasets folder's Arrow file too


def test_preprocessed_store_is_the_same_and_refuses_tampering(tmp_path, capsys):
    from recipes.esm2 import preprocess

    store = read_store(SAMPLE)
    preprocess.main(["--input", str(SAMPLE), "--out", str(tmp_path / "store")])
    with pytest.raises(SystemExit) as stop:
        preprocess.main(["--input", str(SAMPLE), "--out", str(tmp_path / "store")])
    assert stop.value.code == 2 and f"error: --out {tmp_path / 'store'} exists" in capsys.readouterr().err
    again = read_store(tmp_path / "store")
    assert len(again) == len(store) == 1000 and np.array_equal(again.offsets, store.offsets)
    assert np.array_equal(np.asarray(again.residues), store.residues)
    assert again.name(3) == store.name(3) and again.name(3).startswith("UniRef90_")
    with open(tmp_path / "store" / "residues.bin", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(ConfigError, match=r"residues.bin is \d+ bytes, not index.json.s residues=\d+"):
        read_store(tmp_path / "store")
    rewrite(tmp_path / "store")
    offsets = np.load(tmp_path / "store" / "offsets.npy")
    offsets[5] += 1
    np.save(tmp_path / "store" / "offsets.npy", offsets)
    with pytest.raises(ConfigError, match="hash"):
        read_store(tmp_path / "store")
    rewrite(tmp_path / "store")
    residues = np.fromfile(tmp_path / "store" / "residues.bin", dtype=np.uint8)
    residues[store.offsets[7]] = 200  # a byte no tokenizer writes
    residues.tofile(tmp_path / "store" / "residues.bin")
    packs = PackedSequences(read_store(tmp_path / "store"), np.array([7]), 64, 64, 1, Masking(), 0, None)
    with pytest.raises(ValueError, match="sequence 7 holds token id 200"):
        packs[0]


def rewrite(store_dir: Path) -> None:
    import shutil

    shutil.rmtree(store_dir)
    write_store(records(SAMPLE, "sequence", "id", "train"), store_dir, str(SAMPLE))


def test_bad_sources_are_named(tmp_path):
    (tmp_path / "x.fasta").write_text("MKT\n>a\nMKT\n")
    with pytest.raises(ValueError, match="x.fasta:1: sequence text before the first '>'"):
        read_store(tmp_path / "x.fasta")
    (tmp_path / "y.csv").write_text("name,seq\na,MKT\n")
    with pytest.raises(ConfigError, match="data.column=sequence: .*y.csv has no such column .*name, seq"):
        read_store(tmp_path / "y.csv")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("nothing here")
    with pytest.raises(ConfigError, match="no sequence files"):
        read_store(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no such file"):
        read_store(tmp_path / "missing.fasta")


# --- masking and packing ------------------------------------------------------------------------
def test_masking_follows_bert_proportions_and_spares_special_tokens():
    residues = encode_residues("LAGVSERTIDPKQNFYMHWC" * 500)
    tokens, labels = crop_and_mask(residues, 20_000, Masking(), torch.Generator().manual_seed(0))
    assert tokens[0] == CLS and tokens[-1] == EOS and labels[0] == labels[-1] == IGNORE
    original = torch.cat([torch.tensor([CLS]), torch.from_numpy(residues.astype(np.int64)), torch.tensor([EOS])])
    selected = labels != IGNORE
    assert abs(selected.float().mean().item() - 0.15) < 0.01
    assert torch.equal(labels[selected], original[selected])
    shown = tokens[selected]
    assert abs((shown == MASK).float().mean().item() - 0.8) < 0.03
    unchanged = (shown == original[selected]).float().mean().item()
    assert abs(unchanged - (0.1 + 0.1 / 20)) < 0.03  # kept, or replaced by itself at random
    assert torch.equal(tokens[~selected], original[~selected])
    assert not torch.isin(tokens[selected], torch.tensor([t for t in SPECIAL if t != MASK])).any()


def test_long_sequences_are_cropped_to_a_window_drawn_per_epoch():
    residues = encode_residues("".join(np.random.default_rng(1).choice(list("LAGVSERTID"), 500)))
    none = Masking(fraction=1e-9)
    windows = set()
    for epoch in range(4):
        tokens, _ = crop_and_mask(residues, 50, none, sample_generator(7, epoch, 3))
        assert len(tokens) == 50 and tokens[0] == CLS and tokens[-1] == EOS
        text = decode(tokens[1:-1])
        assert text in decode(residues)
        windows.add(text)
        again, _ = crop_and_mask(residues, 50, none, sample_generator(7, epoch, 3))
        assert torch.equal(tokens, again)
    assert len(windows) == 4


def test_plan_packs_fills_in_order_within_budget_and_slots():
    lengths = np.array([5, 3, 4, 6, 2, 2, 2, 8])
    starts = plan_packs(lengths, budget=10, max_sequences=3)
    assert starts.tolist() == [0, 2, 4, 7, 8]  # [5 3] [4 6] [2 2 2] (slots) [8]
    assert plan_packs(np.array([10, 10]), 10, 5).tolist() == [0, 1, 2]
    assert plan_packs(np.array([2, 2, 2, 2, 8]), 10, 3).tolist() == [0, 3, 5]  # the slot limit closes the first


def plain_rule(lengths: list[int], budget: int, max_sequences: int) -> list[int]:
    """Pack starts by the rule as stated, over the whole list at once: a pack closes when the next sequence does
    not fit in its budget or it holds max_sequences."""
    starts, used, count = [0], 0, 0
    for i, n in enumerate(lengths):
        if used + n > budget or count == max_sequences:
            starts.append(i)
            used, count = 0, 0
        used += n
        count += 1
    return starts + [len(lengths)]


@pytest.mark.parametrize("shuffle_seed", [77, None])
def test_packs_planned_a_chunk_at_a_time_are_the_plain_rules_at_under_12_bytes_a_sequence(monkeypatch, shuffle_seed):
    """Planning in chunks (many here: 4,096 sequences each) with the order shuffled in place gives the packs of the
    plain rule over the order 8067eef drew (indices[rng.permutation(n)]); the planning's peak allocations are the
    order itself and a chunk's temporaries (8067eef: about 45 bytes a sequence, a list of every length)."""
    import tracemalloc

    from recipes.esm2 import packing
    from recipes.esm2.sequences import SequenceStore

    monkeypatch.setattr(packing, "PLAN_CHUNK", 4096, raising=False)  # (8067eef has none)
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(np.log(284), 0.69, 220_000), 1, 35_000).astype(np.int64)  # proteins' spread
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    store = SequenceStore(np.zeros(0, dtype=np.uint8), offsets, None, "test")
    indices = np.flatnonzero(rng.random(len(lengths)) < 0.9)  # a training split's
    tracemalloc.start()
    packs = PackedSequences(store, indices, 4096, 1024, 12, Masking(), seed=0, shuffle_seed=shuffle_seed)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    order = indices if shuffle_seed is None else indices[np.random.default_rng(shuffle_seed).permutation(len(indices))]
    framed = np.minimum(lengths[order], 1022) + 2
    assert np.array_equal(packs.order, order)
    assert packs.starts.tolist() == plain_rule(framed.tolist(), 4096, 12)
    assert packs.real_tokens == int(framed.sum()) and len(packs) > 15_000
    assert peak / len(indices) < 12, f"{peak / len(indices):.1f} bytes a sequence"
    print(f"planning peak: {peak / len(indices):.1f} bytes a sequence")


def test_packs_hold_every_sequence_once_with_fixed_shapes():
    store = small_store(40, longest=90)
    packs = PackedSequences(
        store, np.arange(40), budget=128, max_length=48, max_sequences=6, masking=Masking(), seed=3, shuffle_seed=11
    )
    seen = []
    for k in range(len(packs)):
        item = packs[EpochIndex(0, k)]
        cu, members = item["cu_seqlens"].long(), item["sequences"]
        assert item["tokens"].shape == (128,) and cu.shape == (packs.slots + 1,)
        assert cu[0] == 0 and cu[-1] == 128 and (cu.diff() >= 0).all() and (cu.diff() <= 48).all()
        real = members[members >= 0].tolist()
        seen += real
        for j, i in enumerate(real):  # each sequence framed in place, the rest padding with no labels
            assert item["tokens"][cu[j]] == CLS and item["tokens"][cu[j + 1] - 1] == EOS
            assert cu[j + 1] - cu[j] == min(len(store.sequence(i)), 46) + 2
        tail = item["tokens"][cu[len(real)] :]
        assert (tail == PAD).all() and (item["labels"][cu[len(real)] :] == IGNORE).all()
    assert sorted(seen) == list(range(40))
    assert packs.real_tokens == sum(min(len(store.sequence(i)), 46) + 2 for i in range(40))


def test_a_sequence_looks_the_same_in_any_pack():
    """Its window and masks come from (seed, epoch, sequence): packed or padded, it is the same tokens."""
    store = small_store(20, longest=70)
    packed = PackedSequences(store, np.arange(20), 256, 48, 16, Masking(), seed=5, shuffle_seed=1)
    padded = PackedSequences(store, np.arange(20), 48, 48, 1, Masking(), seed=5, shuffle_seed=None)
    for epoch in (0, 3):
        by_sequence = {}
        for k in range(len(padded)):
            item = padded[EpochIndex(epoch, k)]
            n = int(item["cu_seqlens"][1])
            by_sequence[int(item["sequences"][0])] = (item["tokens"][:n], item["labels"][:n])
        for k in range(len(packed)):
            item = packed[EpochIndex(epoch, k)]
            cu = item["cu_seqlens"]
            for j, i in enumerate(item["sequences"][item["sequences"] >= 0].tolist()):
                tokens, labels = by_sequence[i]
                assert torch.equal(item["tokens"][cu[j] : cu[j + 1]], tokens)
                assert torch.equal(item["labels"][cu[j] : cu[j + 1]], labels)


# --- the model ----------------------------------------------------------------------------------
def batch_of(packs: PackedSequences, ks, epoch=0) -> dict:
    items = [packs[EpochIndex(epoch, k)] for k in ks]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def test_packed_and_padded_batches_give_the_same_loss():
    torch.manual_seed(0)
    cfg = model_config()
    model = ESM2(cfg, TORCH_LAYERS).double()
    store = small_store(12, longest=60)
    packed = PackedSequences(store, np.arange(12), 160, 40, 8, Masking(fraction=0.3), seed=2, shuffle_seed=4)
    padded = PackedSequences(store, np.arange(12), 40, 40, 1, Masking(fraction=0.3), seed=2, shuffle_seed=None)
    a, b = batch_of(packed, range(len(packed))), batch_of(padded, range(len(padded)))
    assert len(packed) < len(padded) == 12
    loss_a = model(a["tokens"], a["cu_seqlens"], labels=a["labels"]).sum()
    loss_b = model(b["tokens"], b["cu_seqlens"], labels=b["labels"]).sum()
    assert (a["labels"] >= 0).sum() == (b["labels"] >= 0).sum() > 0
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=0)  # the cross-entropy is fp32 (as TE's)


def test_work_counts_real_tokens_and_each_sequences_attention():
    from recipes.esm2.recipe import ESM2Recipe
    from tests.support.helpers import validated_config

    cfg = validated_config("esm2_sanity", ["checkpoint.path=unused", "model.max_seq_length=40"])
    recipe = ESM2Recipe(cfg)
    store = small_store(12, longest=60)
    packs = PackedSequences(store, np.arange(12), 160, 40, 8, Masking(), seed=2, shuffle_seed=4)
    batch = batch_of(packs, range(2))
    tokens, flops = recipe.work(batch)
    lengths = [min(len(store.sequence(i)), 38) + 2 for i in batch["sequences"].flatten().tolist() if i >= 0]
    assert tokens.item() == sum(lengths) == (batch["tokens"] != PAD).sum().item()
    n, m = recipe.non_embedding_parameters(), cfg.model
    assert flops.item() == 6.0 * n * sum(lengths) + 12.0 * m.num_layers * m.hidden_size * sum(s * s for s in lengths)


def test_token_dropout_rescales_each_sequence_by_its_share_of_masks():
    model = ESM2(model_config(), TORCH_LAYERS).double()
    tokens = torch.tensor([CLS, 5, MASK, 6, EOS, CLS, 7, 8, EOS, PAD, PAD, PAD])
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    x = model.embed(tokens, cu)
    table = model.embedding.weight
    assert torch.all(x[2] == 0) and torch.all(x[9:] == 0)
    torch.testing.assert_close(x[1], table[5] * (1 - MASK_RATIO_TRAIN) / (1 - 1 / 5))
    torch.testing.assert_close(x[6], table[7] * (1 - MASK_RATIO_TRAIN))


def hf_model(cfg):
    from transformers import EsmConfig, EsmForMaskedLM

    return EsmForMaskedLM(EsmConfig(**esm_hf.hf_config(cfg))).eval()


@pytest.mark.parametrize("fuse_qkv_params", [True, False])
def test_our_model_equals_hugging_faces_both_ways(fuse_qkv_params):
    """Ours -> EsmForMaskedLM's weights, and EsmForMaskedLM's (randomly initialised) -> ours: the same logits
    (fp32, 1e-5 relative) on right-padded sequences, ours packed."""
    torch.manual_seed(0)
    cfg = model_config(fuse_qkv_params=fuse_qkv_params)
    ours = ESM2(cfg, TORCH_LAYERS).eval()
    with torch.no_grad():  # biases and norms away from their initial 0 and 1, so that a mix-up shows
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sequences = [[CLS, 5, 6, MASK, 7, 8, EOS], [CLS, 9, MASK, MASK, 10, 11, 12, 13, 14, EOS], [CLS, 20, 21, EOS]]
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), PAD)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s)
    attention = (ids != PAD).long()
    packed = torch.tensor([[t for s in sequences for t in s] + [PAD] * 3])
    cu = torch.tensor([[0, 7, 17, 21, 24]], dtype=torch.int32)

    def compare(hf, model):
        theirs = hf(input_ids=ids, attention_mask=attention).logits
        mine = model(packed, cu)[0]
        for row, (s, start) in enumerate(zip(sequences, cu[0].tolist())):
            torch.testing.assert_close(mine[start : start + len(s)], theirs[row, : len(s)], rtol=1e-5, atol=1e-5)

    hf = hf_model(cfg)
    result = hf.load_state_dict(esm_hf.to_hf(ours.state_dict(), cfg), strict=False)
    assert set(result.missing_keys) == {"esm.contact_head.regression.weight", "esm.contact_head.regression.bias"}
    assert not result.unexpected_keys
    compare(hf, ours)
    fresh = hf_model(cfg)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    back = ESM2(cfg, TORCH_LAYERS).eval()
    loaded = back.load_state_dict(esm_hf.from_hf(fresh.state_dict(), cfg), strict=False)
    assert not loaded.unexpected_keys and not loaded.missing_keys
    compare(fresh, back)


def test_te_gelu_differs_from_hugging_faces_by_little():
    """model.activation=gelu (TE's tanh form) against the exact GELU of ESM-2: logits close, not equal."""
    torch.manual_seed(0)
    exact = ESM2(model_config(), TORCH_LAYERS).eval()
    tanh = ESM2(model_config(activation="gelu"), TORCH_LAYERS).eval()
    tanh.load_state_dict(exact.state_dict())
    tokens = torch.tensor([[CLS] + list(range(4, 24)) + [EOS, PAD, PAD]])
    cu = torch.tensor([[0, 22, 24, 24]], dtype=torch.int32)
    a, b = exact(tokens, cu), tanh(tokens, cu)
    assert 0 < (a - b).abs().max() < 1e-2 * a.abs().max()


# --- training runs ------------------------------------------------------------------------------
def masked_losses_against_residue_frequencies(step_dir: Path, val_fraction: float, draws: int = 4) -> torch.Tensor:
    """[masked residues, 2]: the trained model's loss and the training residues' frequency model's loss on the
    same held-out residues shown as <mask> (the validation split of the run, masked `draws` times)."""
    from omegaconf import OmegaConf

    from core.checkpointing.weights import read_model_weights

    cfg = OmegaConf.load(step_dir / "config.yaml")
    model = ESM2(cfg.model, TORCH_LAYERS).eval()
    model.load_state_dict(read_model_weights(step_dir), strict=False)
    store = read_store(SAMPLE)
    order = np.random.default_rng(cfg.data.split_seed).permutation(len(store))
    held_out = round(len(store) * val_fraction)
    counts = np.bincount(np.concatenate([store.sequence(i) for i in order[held_out:]]), minlength=len(VOCABULARY))
    log_frequency = torch.tensor(np.log((counts + 1.0) / (counts + 1.0).sum()))
    rows = []
    for draw in range(draws):
        packs = PackedSequences(
            store,
            np.sort(order[:held_out]),
            1024,
            cfg.model.max_seq_length,
            16,
            Masking(),
            seed=1000 + draw,
            shuffle_seed=None,
        )
        for k in range(len(packs)):
            item = packs[k]
            with torch.no_grad():
                loss = model(item["tokens"][None], item["cu_seqlens"][None], labels=item["labels"][None])[0]
            shown_masked = (item["tokens"] == MASK) & (item["labels"] >= 0)
            rows.append(torch.stack([loss[shown_masked].double(), -log_frequency[item["labels"][shown_masked]]], 1))
    return torch.cat(rows)


@pytest.mark.slow
def test_esm2_sanity_learns_more_than_residue_frequencies_on_two_processes(tmp_path):
    """esm2_sanity on 2 processes: validation runs and reports its perplexities, and on the held-out sequences'
    masked residues the model's loss is below what the training residues' frequencies give, by more than 3
    standard errors of the paired difference (a model that learned only the frequencies scores equal)."""
    from tests.support.checkpoint_harness import run_phases
    from tests.support.helpers import read_records, run_workers

    overrides = [
        "training.steps=100",
        "training.val_every_n_steps=50",
        "logger.progress_bar=never",
        f"checkpoint.path={tmp_path}/ckpt",
    ]
    run_workers(2, run_phases, [{"config": "esm2_sanity", "run_dir": str(tmp_path / "run"), "overrides": overrides}])
    rows = read_records(tmp_path / "run")
    val = [r for r in rows if r.get("split") == "val"]
    assert [r["step"] for r in val] == [50, 100]
    assert val[-1]["perplexity"] == pytest.approx(math.exp(val[-1]["loss"]), rel=1e-6)
    assert val[-1]["masked_perplexity"] < 18.5
    pairs = masked_losses_against_residue_frequencies(tmp_path / "ckpt" / "step_100", val_fraction=0.05)
    gain = pairs[:, 1] - pairs[:, 0]
    standard_error = gain.std().item() / math.sqrt(len(gain))
    print(
        f"masked residues {len(gain)}: model perplexity {pairs[:, 0].mean().exp():.3f}, residue frequencies "
        f"{pairs[:, 1].mean().exp():.3f}, gain {gain.mean():.4f} +- {standard_error:.4f} nats"
    )
    assert gain.mean() > 3 * standard_error


TINY_ESM = [
    "training.steps=6",
    "training.global_batch_size=4",
    "training.micro_batch_size=1",
    "training.log_every_n_steps=1",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "data.tokens_per_pack=256",
    "model.max_seq_length=64",
    "scheduler.warmup_steps=2",
    "logger.progress_bar=never",
]
DROPOUT = ["model.hidden_dropout=0.1"]  # so that the RNG state matters too


@pytest.mark.slow
def test_a_packed_run_stopped_by_sigterm_resumes_bit_for_bit_and_on_another_rank_count(tmp_path):
    """Packed esm2_sanity with dropout, stopped by SIGTERM (at step 3's end; the ranks agree to stop after step 4)
    and started again: its losses equal an uninterrupted run's bit for bit. Without dropout (whose masks depend
    on the rank), a 2-process checkpoint resumed on one process continues the same global stream of packs:
    the 2-process run's losses, within float summation order."""
    from tests.support.checkpoint_harness import run_phases
    from tests.support.helpers import run_workers

    def phase(name, ckpt, extra=(), **kw):
        return {
            "config": "esm2_sanity",
            "run_dir": str(tmp_path / name),
            "overrides": TINY_ESM + list(extra) + [f"checkpoint.path={tmp_path}/{ckpt}"],
            **kw,
        }

    ref, stopped, resumed, plain = run_workers(
        2,
        run_phases,
        [
            phase("ref", "a", DROPOUT),
            phase("stopped", "b", DROPOUT, signal_at=3),
            phase("resumed", "b", DROPOUT),
            phase("plain", "c", ["checkpoint.save_every_n_steps=4"]),
        ],
    )[0]
    assert sorted(ref["losses"]) == list(range(1, 7))
    assert stopped["stopped_by"] == "SIGTERM" and max(stopped["losses"]) == 4 and resumed["start_step"] == 4
    assert stopped["losses"] | resumed["losses"] == ref["losses"]
    (one,) = run_workers(1, run_phases, [phase("one", "d", [f"checkpoint.resume={tmp_path}/c/step_4"])])[0]
    assert one["start_step"] == 4 and sorted(one["losses"]) == [5, 6]
    for step in (5, 6):
        assert one["losses"][step] == pytest.approx(plain["losses"][step], rel=1e-5)


@pytest.mark.slow
def test_checkpoint_to_hf_and_back_through_the_command_line(tmp_path):
    """A trained esm2_sanity step folder -> `checkpoint.py to-hf` -> EsmForMaskedLM and EsmTokenizer load it and
    give our logits (fp32, 1e-5) -> `checkpoint.py from-hf` -> the same weights as the run's."""
    from transformers import EsmForMaskedLM, EsmTokenizer

    import checkpoint
    from core.checkpointing.weights import load_weights_file, read_model_weights
    from tests.support.checkpoint_harness import run_phases
    from tests.support.helpers import run_workers

    overrides = [
        "training.steps=2",
        "training.val_at_end=false",
        "logger.progress_bar=never",
        "model.activation=gelu_erf",
        f"checkpoint.path={tmp_path}/ckpt",
    ]
    run_workers(1, run_phases, [{"config": "esm2_sanity", "run_dir": str(tmp_path / "run"), "overrides": overrides}])
    step = tmp_path / "ckpt" / "step_2"
    checkpoint.main(["to-hf", str(step), str(tmp_path / "hf")])
    hf = EsmForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = EsmTokenizer.from_pretrained(tmp_path / "hf")
    sequences = ["MKTAYIAKQRQISFVKSHFSRQ", "LLGVSE", "MSTNPKPQRKTKRNTNRRPQDVKFPGG"]
    encoded = tokenizer(sequences, padding=True, return_tensors="pt")
    assert encoded["input_ids"][0, :4].tolist() == [CLS, 20, 15, 11]
    theirs = hf(**encoded).logits
    weights = read_model_weights(step)
    from omegaconf import OmegaConf

    ours = ESM2(OmegaConf.load(step / "config.yaml").model, TORCH_LAYERS).eval()
    ours.load_state_dict(weights, strict=False)
    lengths = encoded["attention_mask"].sum(1).tolist()
    packed = torch.cat([encoded["input_ids"][i, :n] for i, n in enumerate(lengths)])[None]
    cu = torch.tensor([[0, *np.cumsum(lengths)]], dtype=torch.int32)
    with torch.no_grad():
        mine = ours(packed, cu)[0]
    for i, (start, n) in enumerate(zip(cu[0].tolist(), lengths)):
        torch.testing.assert_close(mine[start : start + n], theirs[i, :n], rtol=1e-5, atol=1e-5)
    checkpoint.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back.safetensors")])
    back = load_weights_file(tmp_path / "back.safetensors")
    assert sorted(back) == sorted(weights)  # all checkpoint.init_from needs, the rotary buffer too
    for name, value in back.items():
        torch.testing.assert_close(
            value[:VOCAB_SIZE] if name in ("embedding.weight", "lm_head.bias") else value,
            weights[name][:VOCAB_SIZE] if name in ("embedding.weight", "lm_head.bias") else weights[name],
            rtol=0,
            atol=0,
        )
    with pytest.raises(SystemExit, match="not 'rotary'"):
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"position_embedding_type": "absolute"}))
        checkpoint.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "other.safetensors")])


def _predict_worker(overrides: list[str], run_dir: str) -> str:
    import predict
    from tests.support.helpers import validated_config

    return str(predict.predict(validated_config("esm2_sanity", overrides), Path(run_dir)).output)


@pytest.mark.slow
def test_predict_writes_one_row_per_sequence_in_order_with_its_embedding(tmp_path):
    """predict.py on 2 processes over the held-out sequences: one row per sequence, in data order, with its name,
    masked perplexity and mean hidden state; the embedding equals the model's on that sequence alone."""
    import csv

    from omegaconf import OmegaConf

    from core.checkpointing.weights import read_model_weights
    from tests.support.checkpoint_harness import run_phases
    from tests.support.helpers import run_workers

    train = [
        "training.steps=2",
        "training.val_at_end=false",
        "logger.progress_bar=never",
        f"checkpoint.path={tmp_path}/ckpt",
    ]
    run_workers(1, run_phases, [{"config": "esm2_sanity", "run_dir": str(tmp_path / "run"), "overrides": train}])
    step = tmp_path / "ckpt" / "step_2"
    overrides = [
        "predict.split=val",
        "predict.micro_batch_size=2",
        f"predict.output={tmp_path}/out/p.csv",
        f"checkpoint.init_from={step}",
        f"checkpoint.path={tmp_path}/unused",
        "logger.progress_bar=never",
    ]
    run_workers(2, _predict_worker, overrides, str(tmp_path / "predict"))
    with open(tmp_path / "out" / "p.csv") as f:
        rows = list(csv.DictReader(f))
    store = read_store(SAMPLE)
    held_out = np.sort(np.random.default_rng(42).permutation(len(store))[:50])
    assert [int(r["sequence"]) for r in rows] == held_out.tolist()
    assert [r["name"] for r in rows] == [store.name(i) for i in held_out]
    assert [int(r["residues"]) for r in rows] == [min(len(store.sequence(i)), 254) for i in held_out]
    assert all(math.isfinite(float(r["masked_perplexity"])) for r in rows if int(r["masked_residues"]) > 0)
    assert sum(int(r["masked_residues"]) for r in rows) > 0.1 * sum(int(r["residues"]) for r in rows)
    model = ESM2(OmegaConf.load(step / "config.yaml").model, TORCH_LAYERS).eval()
    model.load_state_dict(read_model_weights(step), strict=False)
    whole = [r for r in rows if len(store.sequence(int(r["sequence"]))) <= 254]  # not cropped (windows are drawn)
    for r in (whole[0], whole[-1]):
        residues = torch.from_numpy(store.sequence(int(r["sequence"])).astype(np.int64))
        tokens = torch.cat([torch.tensor([CLS]), residues, torch.tensor([EOS])])[None]
        with torch.no_grad():
            hidden = model(tokens, torch.tensor([[0, tokens.shape[1]]], dtype=torch.int32), hidden_layer=2)[0]
        expected = hidden[1:-1].mean(0)
        got = torch.tensor([float(r[f"embedding_{k}"]) for k in range(64)])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    metrics = json.loads((tmp_path / "out" / "prediction_metrics.json").read_text())
    assert metrics["sequences"] == metrics["rows"] == 50


@pytest.mark.parametrize(
    "overrides,key,suggested",
    [
        (["data.tokens_per_pack=1000"], "data.tokens_per_pack=1000", "data.tokens_per_pack=1008"),
        (["data.packing=false", "model.max_seq_length=100"], "model.max_seq_length=100", "model.max_seq_length=112"),
    ],
)
def test_fp8_refuses_rows_that_are_not_a_multiple_of_16_tokens(overrides, key, suggested):
    from recipes.esm2.recipe import ESM2Recipe
    from tests.support.helpers import validated_config

    fp8 = ["checkpoint.path=unused", "precision=fp8_delayed"]
    with pytest.raises(ConfigError, match=f"{key} with precision.fp8.enabled=true: .* multiple of 16 .*{suggested}"):
        ESM2Recipe(validated_config("esm2_sanity", fp8 + overrides)).pack_shape()
    assert ESM2Recipe(validated_config("esm2_sanity", overrides + ["checkpoint.path=unused"])).pack_shape()[0] in (
        1000,
        100,
    )
    assert ESM2Recipe(validated_config("esm2_sanity", fp8 + ["data.tokens_per_pack=1024"])).pack_shape()[0] == 1024
