"""Context parallelism in the ESM-2 recipe (distributed.cp): packed sequences padded to multiples of 2 x cp, each
rank holding chunks r and 2 x cp - 1 - r of every sequence. Padding within a sequence's slot changes nothing for
its real tokens; cp=2 trains as one process on the same packs; a cp=2 run stops and resumes exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from core.config.errors import ConfigError
from core.data.datasets import EpochIndex
from core.layers.context_parallel import ContextParallel, packed_load_balanced_positions
from core.layers.namespace import TORCH_LAYERS
from recipes.esm2.masking import IGNORE, Masking
from recipes.esm2.model import ESM2
from recipes.esm2.packing import PackedSequences
from recipes.esm2.tokenizer import CLS, EOS, PAD
from tests.recipes.esm2.test_esm2 import model_config, small_store
from tests.support.checkpoint_harness import run_phases
from tests.support.helpers import read_records, run_workers, validated_config


def test_padded_packs_put_each_sequence_at_a_multiple_and_say_its_real_length():
    store = small_store(40, longest=90)
    packs = PackedSequences(store, np.arange(40), 128, 48, 6, Masking(), seed=3, shuffle_seed=11, multiple=4)
    seen = []
    for k in range(len(packs)):
        item = packs[EpochIndex(0, k)]
        cu, real, members = item["cu_seqlens"].long(), item["seqlens"].long(), item["sequences"]
        assert cu[-1] == 128 and (cu % 4 == 0).all() and (cu.diff() <= 48).all() and real.shape == (packs.slots,)
        present = members[members >= 0].tolist()
        seen += present
        for j, i in enumerate(present):
            n = min(len(store.sequence(i)), 46) + 2
            assert real[j] == n and cu[j + 1] - cu[j] == -(-n // 4) * 4
            assert item["tokens"][cu[j]] == CLS and item["tokens"][cu[j] + n - 1] == EOS
            assert (item["tokens"][cu[j] + n : cu[j + 1]] == PAD).all()
            assert (item["labels"][cu[j] + n : cu[j + 1]] == IGNORE).all()
        assert (real[len(present) :] == cu.diff()[len(present) :]).all()  # the padding's pieces, and empty slots
    assert sorted(seen) == list(range(40))
    with pytest.raises(ValueError, match="multiples of 4"):
        PackedSequences(store, np.arange(40), 130, 48, 6, Masking(), seed=3, shuffle_seed=None, multiple=4)


def _padded_pack(lengths, multiple, generator):
    """Sequences of `lengths` tokens packed in one row, each slot padded to `multiple`: tokens, cu_seqlens, seqlens
    and each real token's place in the row."""
    tokens, offsets, places = [], [0], []
    for n in lengths:
        sequence = torch.randint(4, 24, (n,), generator=generator)
        sequence[0], sequence[-1] = CLS, EOS
        width = -(-n // multiple) * multiple
        places += range(offsets[-1], offsets[-1] + n)
        tokens.append(torch.cat([sequence, torch.full((width - n,), PAD)]))
        offsets.append(offsets[-1] + width)
    row = torch.cat(tokens)
    return row[None], torch.tensor([offsets], dtype=torch.int32), torch.tensor([lengths], dtype=torch.int32), places


def test_padding_within_a_sequence_changes_nothing_for_its_real_tokens():
    """The same sequences packed without padding and padded to multiples of 8 (TE's cu_seqlens_padded layout): the
    logits of every real token agree (the twin masks the padding out of attention; ESM-2's token dropout counts real
    tokens)."""
    torch.manual_seed(0)
    model = ESM2(model_config(), TORCH_LAYERS).double()
    generator = torch.Generator().manual_seed(1)
    lengths = [13, 5, 22]
    plain, plain_cu, _, plain_places = _padded_pack(lengths, 1, generator)
    generator.manual_seed(1)
    padded, padded_cu, seqlens, places = _padded_pack(lengths, 8, generator)
    plain[0, 3] = padded[0, 3] = 32  # a <mask> token: token dropout's share
    assert torch.equal(plain[0, plain_places], padded[0, places])  # the same tokens (the same generator)
    expected = model(plain, plain_cu)[0, plain_places]
    got = model(padded, padded_cu, seqlens=seqlens)[0, places]
    assert (got - expected).abs().max() < 1e-10
    # (without the real lengths the padding would be attended to, as sequence tokens)
    assert (model(padded, padded_cu)[0, places] - expected).abs().max() > 1e-4


def _cp_worker(size: int) -> dict:
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        torch.manual_seed(0)
        whole = ESM2(model_config(), TORCH_LAYERS).double()
        layers = replace(TORCH_LAYERS, cp=ContextParallel(size, rank, dist.group.WORLD, tuple(range(size))))
        shared = ESM2(model_config(), layers).double()
        shared.load_state_dict(whole.state_dict())
        layers.cp.apply(shared, layers.TransformerLayer)
        generator = torch.Generator().manual_seed(2)
        tokens, cu, seqlens, _ = _padded_pack([13, 5, 22, 9], 2 * size, generator)
        tokens[0, 2] = 32  # <mask>
        labels = torch.where(tokens == PAD, IGNORE, tokens)
        ref = whole(tokens, cu, labels=labels, seqlens=seqlens)
        index = packed_load_balanced_positions(cu[0], size, rank)[None]
        mine = shared(tokens.gather(1, index), cu, labels=labels.gather(1, index), seqlens=seqlens)
        ref.sum().backward()
        mine.sum().backward()
        diffs = {"loss": (mine - ref.gather(1, index)).abs().max().item()}
        for (name, p), q in zip(shared.named_parameters(), whole.parameters()):
            dist.all_reduce(p.grad)
            diffs[name] = (p.grad - q.grad).abs().max().item()
        return diffs
    finally:
        dist.destroy_process_group()


def test_each_ranks_share_gives_the_whole_models_losses_and_gradients():
    for rank, diffs in enumerate(run_workers(2, _cp_worker, 2)):
        assert max(diffs.values()) < 1e-10, (rank, diffs)


STEPS = [
    "training.log_every_n_steps=1",
    "training.val_at_end=false",
    "data.num_workers=0",
    "logger.progress_bar=never",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
    "data.pad_sequences_to_multiple_of=4",  # the packs cp=2 makes, at cp=1 too
]


@pytest.mark.slow
def test_context_parallel_trains_as_one_process_and_stops_and_resumes_exactly(tmp_path):
    """esm2_sanity on the same packs: cp=2 gives one process's losses, gradient norms and validation losses over 4
    steps; a cp=2 run stopped by SIGTERM after step 3 (it saves step 4) and started again equals it bit for bit."""

    def phase(name, overrides, **extra):
        return {"config": "esm2_sanity", "run_dir": str(tmp_path / name), "overrides": overrides, **extra}

    common = STEPS + ["training.steps=4", "training.val_every_n_steps=2", "training.limit_val_batches=2"]
    run_workers(1, run_phases, [phase("one", common + [f"checkpoint.path={tmp_path}/c1"])])
    ranks = run_workers(
        2,
        run_phases,
        [
            phase("cp2", common + ["distributed.cp=2", f"checkpoint.path={tmp_path}/c2"]),
            phase("stopped", common + ["distributed.cp=2", f"checkpoint.path={tmp_path}/c3"], signal_at=1),
            phase("resumed", common + ["distributed.cp=2", f"checkpoint.path={tmp_path}/c3"]),
        ],
    )
    one, cp2 = (read_records(tmp_path / name) for name in ("one", "cp2"))
    train = [{r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "split" not in r} for rows in (one, cp2)]
    val = [{r["step"]: r["loss"] for r in rows if r.get("split") == "val"} for rows in (one, cp2)]
    assert sorted(train[0]) == sorted(train[1]) == [1, 2, 3, 4] and sorted(val[0]) == sorted(val[1]) == [2, 4]
    for step, (loss, grad_norm) in train[0].items():
        assert train[1][step][0] == pytest.approx(loss, rel=1e-5), step
        assert train[1][step][1] == pytest.approx(grad_norm, rel=1e-4), step
    for step, loss in val[0].items():
        assert val[1][step] == pytest.approx(loss, rel=1e-5), step
    full, stopped, resumed = ranks[0]
    assert stopped["stopped_by"] == "SIGTERM" and max(stopped["losses"]) == 2 and resumed["start_step"] == 2
    assert stopped["losses"] | resumed["losses"] == full["losses"]  # bit for bit


def test_what_cannot_be_split_is_refused_before_any_work():
    from recipes.esm2.recipe import ESM2Recipe
    from recipes.esm2_finetune.recipe import ESM2FinetuneRecipe

    def recipe(*overrides):
        return ESM2Recipe(validated_config("esm2_sanity", ["checkpoint.path=unused", *overrides]))

    assert recipe("distributed.cp=2").sequence_multiple() == 4
    assert recipe("distributed.cp=2", "data.pad_sequences_to_multiple_of=16").sequence_multiple() == 16
    assert recipe().sequence_multiple() == 1
    with pytest.raises(ConfigError, match="pad_sequences_to_multiple_of=6 with distributed.cp=2.*multiple of 4"):
        recipe("distributed.cp=2", "data.pad_sequences_to_multiple_of=6").check_context_parallel(2)
    with pytest.raises(ConfigError, match="data.tokens_per_pack=1020: sequences are padded to multiples of 8"):
        recipe("distributed.cp=4", "data.tokens_per_pack=1020").check_context_parallel(4)
    with pytest.raises(ConfigError, match="model.max_seq_length=250: sequences are padded to multiples of 4"):
        recipe("distributed.cp=2", "model.max_seq_length=250").check_context_parallel(2)
    with pytest.raises(
        ConfigError, match=r"1040 with precision.fp8.enabled=true.*each of distributed.cp=2 ranks holds 520"
    ):
        recipe("distributed.cp=2", "data.tokens_per_pack=1040", "precision=fp8_delayed").pack_shape()
    assert recipe("distributed.cp=2", "data.tokens_per_pack=1056", "precision=fp8_delayed").pack_shape()[0] == 1056
    te = replace(TORCH_LAYERS, name="te")  # (refused before any layer is built: no TE needed)
    with pytest.raises(ConfigError, match="need 16-bit attention on TransformerEngine layers"):
        recipe("distributed.cp=2").build_model(te, torch.device("meta"))
    finetune = validated_config(
        "esm2_finetune_sanity", ["checkpoint.path=unused", "checkpoint.init_from=null", "distributed.cp=2"]
    )
    with pytest.raises(ConfigError, match="the esm2_finetune recipe does not split its samples"):
        ESM2FinetuneRecipe(finetune).check_context_parallel(2)
