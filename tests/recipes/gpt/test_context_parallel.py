"""Context parallelism in the GPT recipe (distributed.cp): each row's tokens split over cp ranks that attend over
each other's keys and values (core/layers/context_parallel.py). A run at cp=2, alone or with data or tensor
parallelism and under each backend, trains as one process does; it stops and resumes exactly, and its checkpoint
resumes without it. What cannot be split is refused before any work."""

from __future__ import annotations

import pytest
import torch

from core.config.errors import ConfigError
from tests.support.checkpoint_harness import run_phases
from tests.support.helpers import read_records, run_workers, validated_config

STEPS4 = [
    "training.steps=4",
    "training.log_every_n_steps=1",
    "training.val_at_end=false",
    "data.num_workers=0",
    "logger.progress_bar=never",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
]


def _figures(folder) -> tuple[dict, dict]:
    rows = read_records(folder)
    train = {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "split" not in r}
    val = {r["step"]: r["loss"] for r in rows if r.get("split") == "val"}
    return train, val


@pytest.mark.slow
def test_context_parallel_trains_as_one_process(tmp_path):
    """gpt_sanity from the same initial weights, 4 steps with validation after steps 2 and 4: cp=2 under fsdp2, ddp
    and Megatron-FSDP ZeRO-3 (the CPU shim), cp=2 x dp=2 and cp=2 x tp=2 give one process's losses, gradient norms
    and validation losses (to float32 rounding: the sums run in another order; with dp=2, limit_val_batches takes
    other samples, so validation is compared at dp=1)."""
    runs = {}
    layouts = (
        ("1 process", 1, [], False),
        ("CP=2", 2, ["distributed.cp=2"], False),
        ("CP=2 ddp", 2, ["distributed.cp=2", "distributed=ddp"], False),
        (
            "CP=2 mfsdp ZeRO-3",
            2,
            ["distributed.cp=2", "distributed=mfsdp", "distributed.mfsdp.zero_dp_strategy=3"],
            True,
        ),
        ("DP=2 x CP=2", 4, ["distributed.cp=2"], False),
        ("CP=2 x TP=2", 4, ["distributed.cp=2", "distributed.tp=2"], False),
    )
    for label, nproc, extra, shim in layouts:
        folder = tmp_path / label.replace(" ", "_").replace("=", "")
        overrides = STEPS4 + extra + [f"data.cache_dir={tmp_path}/cache", f"checkpoint.path={folder}/c"]
        overrides += ["training.val_every_n_steps=2", "training.limit_val_batches=2"]
        run_workers(nproc, run_phases, [{"config": "gpt_sanity", "run_dir": str(folder), "overrides": overrides}], shim)
        runs[label] = _figures(folder)
    (train, val) = runs["1 process"]
    assert sorted(train) == [1, 2, 3, 4] and sorted(val) == [2, 4]
    assert train[4][0] < train[1][0]  # it learns
    for label, (other_train, other_val) in runs.items():
        assert sorted(other_train) == [1, 2, 3, 4] and sorted(other_val) == [2, 4], label
        for step, (loss, grad_norm) in train.items():
            assert other_train[step][0] == pytest.approx(loss, rel=1e-5), (label, step, other_train, train)
            assert other_train[step][1] == pytest.approx(grad_norm, rel=1e-4), (label, step, other_train, train)
        for step, loss in val.items() if not label.startswith("DP=2") else ():  # (limit_val_batches is per rank)
            assert other_val[step] == pytest.approx(loss, rel=1e-5), (label, step, other_val, val)


@pytest.mark.slow
def test_context_parallel_fine_tunes_on_chat_rows_as_one_process(tmp_path):
    """gpt_sft_sanity (the tiny Llama on the shipped chats, one conversation per row of 256 tokens, loss on the
    replies only): cp=2 gives one process's losses and gradient norms, and the same real tokens per second per GPU
    as work counted whole on each rank and shared among the two."""
    runs = {}
    for label, nproc, extra in (("one", 1, []), ("cp2", 2, ["distributed.cp=2"])):
        folder = tmp_path / label
        overrides = STEPS4 + ["data.packing=false", "training.val_every_n_steps=0", f"checkpoint.path={folder}/c"]
        run_workers(
            nproc, run_phases, [{"config": "gpt_sft_sanity", "run_dir": str(folder), "overrides": overrides + extra}]
        )
        runs[label] = read_records(folder)
    one, cp2 = ({r["step"]: r for r in rows if "split" not in r} for rows in (runs["one"], runs["cp2"]))
    assert sorted(one) == sorted(cp2) == [1, 2, 3, 4]
    for step in one:
        assert cp2[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), step
        assert cp2[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), step
        # real tokens per step: the same rows on 1 GPU, or shared by 2
        one_tokens = one[step]["tokens_per_sec_per_gpu"] * one[step]["step_time"]
        assert cp2[step]["tokens_per_sec_per_gpu"] * cp2[step]["step_time"] == pytest.approx(one_tokens / 2, rel=1e-6)


@pytest.mark.slow
def test_context_parallel_fine_tunes_on_packed_chat_rows_as_one_process(tmp_path):
    """gpt_sft_sanity as shipped (conversations packed into rows of 256 tokens with document masks), each
    conversation padded to a multiple of 4: cp=2 (each rank a half of every conversation, chunks r and 3 - r) gives
    one process's losses and gradient norms on the same rows (data.pad_sequences_to_multiple_of=4 there)."""
    runs = {}
    for label, nproc, extra in (("one", 1, ["data.pad_sequences_to_multiple_of=4"]), ("cp2", 2, ["distributed.cp=2"])):
        folder = tmp_path / label
        overrides = STEPS4 + ["training.val_every_n_steps=0", f"checkpoint.path={folder}/c", *extra]
        run_workers(nproc, run_phases, [{"config": "gpt_sft_sanity", "run_dir": str(folder), "overrides": overrides}])
        runs[label] = {r["step"]: r for r in read_records(folder) if "split" not in r}
    one, cp2 = runs["one"], runs["cp2"]
    assert sorted(one) == sorted(cp2) == [1, 2, 3, 4]
    assert one[4]["loss"] < one[1]["loss"]
    for step in one:
        assert cp2[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), step
        assert cp2[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), step


@pytest.mark.slow
def test_a_context_parallel_run_stops_and_resumes_exactly_and_without_it(tmp_path):
    """cp=2 stopped by SIGTERM after step 3 (it saves step 4) and started again equals the uninterrupted cp=2 run bit
    for bit; its step-4 checkpoint resumes on one process (cp=1) with the same losses to rounding."""
    common = STEPS4[1:] + ["training.steps=8", "training.val_every_n_steps=0", f"data.cache_dir={tmp_path}/cache"]
    cp2 = common + ["distributed.cp=2"]

    def phase(name, checkpoints, overrides, **extra):
        return {
            "config": "gpt_sanity",
            "run_dir": str(tmp_path / name),
            "overrides": overrides + [f"checkpoint.path={tmp_path / checkpoints}"],
            **extra,
        }

    ranks = run_workers(
        2,
        run_phases,
        [phase("ref", "ckpt_ref", cp2), phase("stopped", "ckpt", cp2, signal_at=3), phase("resumed", "ckpt", cp2)],
    )
    ref, stopped, resumed = ranks[0]
    assert stopped["stopped_by"] == "SIGTERM" and max(stopped["losses"]) == 4 and resumed["start_step"] == 4
    assert stopped["losses"] | resumed["losses"] == ref["losses"]  # bit for bit
    one = run_workers(
        1, run_phases, [phase("one", "ckpt_one", common + [f"checkpoint.resume={tmp_path}/ckpt/step_4"])]
    )[0][0]
    assert one["start_step"] == 4 and sorted(one["losses"]) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert one["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-5), step


def test_what_cannot_be_split_is_refused_before_any_work():
    from recipes.gpt.recipe import GPTRecipe
    from recipes.vit.recipe import ViTRecipe

    def gpt(*overrides):
        return GPTRecipe(validated_config("gpt_sanity", ["checkpoint.path=unused", *overrides]))

    gpt().check_context_parallel(4)  # 128 tokens: 8 chunks of 16
    with pytest.raises(ConfigError, match="model.seq_length=128 with distributed.cp=3.*multiple of 6"):
        gpt().check_context_parallel(3)
    with pytest.raises(ConfigError, match="data.packing=true on data.format=text: a pretraining sample's documents"):
        gpt("data.packing=true").check_context_parallel(2)

    def sft(*overrides):
        return GPTRecipe(validated_config("gpt_sft_sanity", ["checkpoint.path=unused", *overrides]))

    sft().check_context_parallel(2)  # packed chat rows: each conversation padded to a multiple of 4
    assert sft().sequence_multiple(2) == 4 and sft("data.pad_sequences_to_multiple_of=8").sequence_multiple(2) == 8
    assert sft().sequence_multiple(1) == 1
    with pytest.raises(ConfigError, match="data.pad_sequences_to_multiple_of=6 with distributed.cp=2.*multiple of 4"):
        sft("data.pad_sequences_to_multiple_of=6").check_context_parallel(2)
    with pytest.raises(ConfigError, match="model.seq_length=256: conversations are padded to multiples of 512"):
        sft("data.pad_sequences_to_multiple_of=512").sequence_multiple(1)
    with pytest.raises(Exception, match="data.pad_sequences_to_multiple_of=4: only packed chat rows"):
        validated_config("gpt_sanity", ["checkpoint.path=unused", "data.pad_sequences_to_multiple_of=4"])
    with pytest.raises(ConfigError, match="model.seq_length=102 with distributed.cp=2"):
        gpt("model.seq_length=102").check_context_parallel(2)
    # TE's context-parallel attention has no fp32 kernel: refused on TE layers, not on the twins
    from core.runtime import Machine, resolve

    fp32 = validated_config("gpt_sanity", ["checkpoint.path=unused", "distributed.cp=2", "precision=fp32"])
    with pytest.raises(ConfigError, match="distributed.cp=2 with fp32 attention on TransformerEngine layers"):
        resolve(fp32, Machine(cuda=True, te=True))
    assert resolve(fp32, Machine(cuda=False, te=False)).layers == "torch"
    bf16 = validated_config("gpt_sanity", ["checkpoint.path=unused", "distributed.cp=2", "precision=bf16"])
    assert resolve(bf16, Machine(cuda=True, te=True)).layers == "te"
    with pytest.raises(ConfigError, match="the vit recipe does not split its samples"):
        ViTRecipe(validated_config("vit_sanity", ["checkpoint.path=unused"])).check_context_parallel(2)


def test_padded_conversations_count_their_positions_not_their_padding():
    """Tokens/s and MFU of packed chat rows padded for context parallelism count each conversation's positions
    (the rows' "seqlens"), not the padding in its slot; the share a cp rank gets leaves those per-slot figures
    whole."""
    from torch.utils.data import default_collate

    from core.layers.context_parallel import ContextParallel
    from recipes.gpt.recipe import GPTRecipe

    recipe = GPTRecipe(
        validated_config("gpt_sft_sanity", ["checkpoint.path=unused", "data.pad_sequences_to_multiple_of=8"])
    )
    train = recipe.build_datasets().train
    batch = default_collate([train[k] for k in range(4)])
    real = sum(len(train.chats.row(i)[0]) - 1 for k in range(4) for i in train.conversations(k))
    slots = sum(int(cu.diff()[:n].sum()) for cu, n in zip(batch["cu_seqlens"], batch["documents"]))
    tokens, _ = recipe.work(batch)
    assert int(tokens) == real == int(batch["seqlens"].sum()) < slots
    share = recipe.context_parallel_share(batch, ContextParallel(2, 1, None, (0, 1)))
    assert share["tokens"].shape == (4, 128) and torch.equal(share["seqlens"], batch["seqlens"])
    assert torch.equal(share["cu_seqlens"], batch["cu_seqlens"])


def test_a_context_parallel_model_hands_its_layers_the_whole_rows_angles():
    """TE's attention rotates a context-parallel rank's bshd share by the angles of that rank's places in the row,
    picking them from the whole row's (its rotary embedding takes cp_size and cp_rank); the twin does the same. The
    GPT given a rank's share of a row hands its layers the whole row's angles, then: picked twice, they would be
    wrong (and TE refuses angles shorter than the row)."""
    from dataclasses import replace

    from core.layers.context_parallel import ContextParallel
    from core.layers.namespace import TORCH_LAYERS
    from recipes.gpt.recipe import GPTRecipe

    recipe = GPTRecipe(validated_config("gpt_sanity", ["checkpoint.path=unused", "model.num_layers=1"]))
    model = recipe.build_model(replace(TORCH_LAYERS, cp=ContextParallel(2, 1, None, (0, 1))), torch.device("cpu"))
    seen = []
    model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["rotary_pos_emb"]), with_kwargs=True
    )
    model(torch.zeros(1, 64, dtype=torch.long))  # (the layers are not made context-parallel: no group here)
    assert torch.equal(seen[0], model.rotary(128))
