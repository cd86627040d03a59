"""The memory plan (core/training/memory_plan.py): estimates against peaks measured on GPUs, what each setting
changes, and the refusal that names settings that fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core.config.errors import ConfigError
from core.training import memory_plan as mp
from recipes.registry import get_recipe
from tests.support.helpers import validated_config

LLAMA_8B = ["model=llama3_8b", "model.vocab_size=32000", "training.micro_batch_size=1"]
CHATS = ["checkpoint.init_from=null", "data.tokenizer=byte", "data.train_path=unused.jsonl"]
TASK = ["checkpoint.init_from=null", "model.classes=[a,b]"]

# Shipped configs as typed (one GPU unless said), and the peak torch allocated in the run's log (peak_mem_gib), from
# benchmarks/results/<folder>.
MEASURED = [
    ("gpt_1b", [], 1, 47.9, "2026-12-02-sft-packing-h200"),
    ("gpt_1b", ["training.micro_batch_size=32"], 1, 80.8, "2026-11-23-perf4-h200"),
    ("gpt_1b", ["model.seq_length=4096", "training.micro_batch_size=8"], 1, 48.0, "2026-11-23-perf4-h200"),
    ("gpt_1b", ["precision.fp8.enabled=true"], 1, 46.6, "2026-11-25-cuda-graphs-2-h200"),
    ("gpt_125m", [], 1, 9.6, "2026-11-25-qkv-rope-h200"),
    ("gpt_125m", ["training.micro_batch_size=32"], 1, 27.9, "2026-11-25-cuda-graphs-2-h200"),
    ("vit_base_patch16_224", [], 1, 18.5, "2026-11-27-two-gpus-h200x2"),
    ("vit_base_patch16_224", [], 2, 17.3, "2026-11-27-two-gpus-h200x2"),
    ("vit_base_patch16_224", ["training.micro_batch_size=512"], 1, 30.8, "2026-11-23-perf4-h200"),
    ("esm2_650m", [], 1, 21.7, "2026-11-27-esm2-and-gpu-suite-h100"),
    ("esm2_650m", ["precision.param_dtype=fp32"], 1, 24.2, "2026-11-27-esm2-and-gpu-suite-h100"),
    ("esm2_3b", [], 1, 70.8, "2026-12-02-jpeg-queues-esm2-3b-h200"),
    ("esm2_8m", [], 1, 0.81, "2026-12-02-context-parallel-h200"),
    ("esm2_150m", [], 1, 7.44, "2026-12-02-context-parallel-h200"),
    ("esm2_finetune", TASK, 1, 21.7, "2026-11-27-esm2-finetune-lora-h200"),
    ("esm2_finetune_lora", TASK, 1, 8.7, "2026-11-27-esm2-finetune-lora-h200"),
    ("llama_sft", [*CHATS, "finetune.mode=lora"], 1, 30.9, "2026-12-02-sft-packing-h200"),
    # the Llama-3-8B shape over gpt_1b with ZeRO-3 on 2 GPUs (../shared/notes: 2 x H200, 2026-11-27)
    ("gpt_1b", [*LLAMA_8B, "distributed.mfsdp.zero_dp_strategy=3"], 2, 83.7, "notes"),
]


def _plan(name, overrides, gpus=1, capacity=None, backend="mfsdp"):
    cfg = validated_config(name, ["checkpoint.path=unused", *overrides])
    recipe = get_recipe(cfg.recipe)(cfg)
    return mp.plan_for_run(cfg, recipe, gpus, gpus, 1, backend, capacity)


@pytest.mark.parametrize("name, overrides, gpus, measured, source", MEASURED, ids=lambda v: None)
def test_estimates_are_within_15_percent_of_measured_peaks(name, overrides, gpus, measured, source):
    plan, _ = _plan(name, overrides, gpus)
    estimate = plan.total / mp.GIB
    assert abs(estimate / measured - 1) < 0.15, (
        f"{name} {overrides} on {gpus}: ~{estimate:.1f} GiB, {measured} measured"
    )


def test_zero_levels_divide_what_they_shard():
    plans = {z: _plan("gpt_1b", [f"distributed.mfsdp.zero_dp_strategy={z}"], gpus=4)[0].parts for z in range(4)}
    assert plans[1]["optimizer state"] == plans[0]["optimizer state"] / 4
    assert plans[1]["master weights"] == plans[0]["master weights"] / 4
    assert plans[1]["gradients"] == plans[0]["gradients"]
    assert plans[2]["gradients"] == plans[0]["gradients"] / 4
    assert plans[2]["weights"] == plans[0]["weights"]
    assert plans[3]["weights"] == plans[0]["weights"] / 4 and plans[3]["gathered units"] > 0
    assert plans[0]["activations"] == plans[3]["activations"]  # data parallelism splits samples, not a sample


def test_context_parallelism_splits_each_samples_tokens_and_shards_with_dp_shard():
    cfg = validated_config("gpt_1b", ["checkpoint.path=unused", "distributed.mfsdp.zero_dp_strategy=3"])
    recipe = get_recipe(cfg.recipe)(cfg)
    dp4 = mp.plan_for_run(cfg, recipe, 4, 4, 1, "mfsdp", None)[0]
    dp2_cp2 = mp.plan_for_run(cfg, recipe, 2, 2, 1, "mfsdp", None, cp=2)[0]
    one = mp.plan_for_run(cfg, recipe, 1, 1, 1, "mfsdp", None)[0]
    for part in ("weights", "master weights", "gradients", "optimizer state", "gathered units"):
        assert dp2_cp2.parts[part] == dp4.parts[part], part  # sharded over dp_shard x cp = 4 ranks either way
    assert dp2_cp2.parts["activations"] == one.parts["activations"] / 2
    assert dp2_cp2.parts["logits"] == one.parts["logits"] / 2
    assert "ZeRO-3 over 4, tp=1, cp=2" in dp2_cp2.lines()[0]


def test_a_long_sequence_is_advised_context_parallelism_where_the_recipe_splits_it():
    long = ["model.seq_length=131072", "training.micro_batch_size=1", "training.global_batch_size=4"]
    plan, advised = _plan("gpt_1b", long, gpus=4, capacity=80 * mp.GIB)
    assert plan.total > 80 * mp.GIB
    overrides, fitting = advised[0]  # no recomputation, one change: 4 ranks of one sample each
    assert overrides == "distributed.cp=4" and fitting.settings.cp == 4 and fitting.settings.dp_shard == 1
    assert fitting.parts["activations"] == plan.parts["activations"] / 4
    cfg = validated_config("gpt_1b", ["checkpoint.path=unused", *long, "distributed.dp_shard=4"])
    given = mp.plan_for_run(cfg, get_recipe("gpt")(cfg), 4, 4, 1, "mfsdp", 80 * mp.GIB)[1]
    assert given[0][0] == "distributed.cp=4 distributed.dp_shard=1"  # a mesh given in full changes with it
    # 131072 tokens do not split into 2 x 3 (or 2 x 6) equal chunks: on 6 GPUs only cp=2 is advised
    six = _plan("gpt_1b", [*long, "training.global_batch_size=6"], gpus=6, capacity=80 * mp.GIB)[1]
    sizes = {p.settings.cp for _, p in six}
    assert 2 in sizes and not sizes & {3, 6}, six
    # nor is it advised for a recipe that has no context parallelism
    vit = _plan("vit_base_patch16_224", ["training.micro_batch_size=4096"], gpus=4, capacity=80 * mp.GIB)[1]
    assert vit and all("distributed.cp" not in o for o, _ in vit)


def test_activation_checkpointing_keeps_each_blocks_input_and_one_block():
    full = _plan("gpt_1b", [])[0]
    checkpointed = _plan("gpt_1b", ["training.activation_checkpointing=true"])[0]
    cfg = validated_config("gpt_1b", ["checkpoint.path=unused"])
    m, tokens = cfg.model, 16 * 2048
    per_block = full.parts["activations"] / m.num_layers
    assert checkpointed.parts["activations"] == pytest.approx(m.num_layers * m.hidden_size * 2 * tokens + per_block)
    assert checkpointed.total < 0.5 * full.total


def test_lora_keeps_no_optimizer_state_for_the_frozen_weights():
    lora = _plan("llama_sft", [*CHATS, "finetune.mode=lora"])[0].parts
    full = _plan("llama_sft", [*CHATS, "finetune.mode=full"])[0].parts
    assert lora["optimizer state"] < full["optimizer state"] / 1000
    assert lora["weights"] == pytest.approx(full["weights"], rel=0.01)  # bf16 either way
    assert lora["activations"] < full["activations"]


def test_the_8b_shape_at_zero_0_is_refused_naming_what_fits():
    """The issue's case: the Llama-3-8B shape typed over gpt_1b (ZeRO-0) on 8 GPUs of 80 GiB."""
    capacity = 80 * mp.GIB
    plan, suggestions = _plan("gpt_1b", LLAMA_8B, gpus=8, capacity=capacity)
    assert plan.total > capacity
    assert suggestions and suggestions[0][0] == "distributed.mfsdp.zero_dp_strategy=3"
    assert all(p.total <= capacity for _, p in suggestions)
    with pytest.raises(ConfigError, match=r"set distributed.mfsdp.zero_dp_strategy=3: ~\d+\.\d GiB") as e:
        mp.check(plan, capacity, suggestions, "refuse")
    assert "training.memory_plan=warn" in str(e.value) and "optimizer state" in str(e.value)
    assert "set distributed.mfsdp.zero_dp_strategy=3" in mp.check(plan, capacity, suggestions, "warn")
    # one GPU: no ZeRO level helps; nothing fits
    plan, suggestions = _plan("gpt_1b", LLAMA_8B, gpus=1, capacity=capacity)
    assert suggestions == []
    with pytest.raises(ConfigError, match="use more GPUs"):
        mp.check(plan, capacity, suggestions, "refuse")


def test_the_shipped_8b_config_fits_four_gpus_of_80_gib_and_names_recomputation_on_two():
    """gpt_8b (the Llama-3-8B shape, rows of 8,192 tokens, ZeRO-3) as typed: each GPU's shard of the weights and
    optimizer state plus one row's activations fit 4 GPUs of 80 GB closely (a warning, no refusal) and 8 with
    room; on 2 the plan stops it, naming activation checkpointing; on 1 nothing fits. An "80 GB" H100 has 81,559
    MiB (nvidia-smi on the lent H100s, benchmarks/results/*h100*/gpu_info.txt)."""
    capacity = 81559 * 2**20
    four = _plan("gpt_8b", [], gpus=4, capacity=capacity)[0]
    assert "little room left" in mp.check(four, capacity, [], "refuse")
    assert mp.check(_plan("gpt_8b", [], gpus=8, capacity=capacity)[0], capacity, [], "refuse") is None
    plan, suggestions = _plan("gpt_8b", [], gpus=2, capacity=capacity)
    assert plan.total > capacity
    assert suggestions[0][0] == "training.activation_checkpointing=true"
    with pytest.raises(ConfigError, match=r"set training.activation_checkpointing=true: ~\d+\.\d GiB"):
        mp.check(plan, capacity, suggestions, "refuse")
    assert _plan("gpt_8b", [], gpus=1, capacity=capacity)[1] == []


def test_a_smaller_micro_batch_that_divides_the_global_batch_is_advised():
    capacity = 40 * mp.GIB  # gpt_1b at micro-batch 16 needs ~48 GiB
    plan, suggestions = _plan("gpt_1b", [], capacity=capacity)
    assert plan.total > capacity
    assert suggestions[0][0] == "training.micro_batch_size=8"  # 128 = 8 x 16: divides; fewest changes first
    assert mp.check(_plan("gpt_1b", [])[0], 140 * mp.GIB, [], "refuse") is None
    assert "little room" in mp.check(plan, plan.total / 0.95, [], "refuse")


def test_a_run_on_a_gpu_that_is_too_small_stops_before_the_model_is_built(monkeypatch, caplog):
    cfg = validated_config("gpt_1b", ["checkpoint.path=unused", *LLAMA_8B])
    recipe = get_recipe(cfg.recipe)(cfg)
    env = SimpleNamespace(device=torch.device("cuda", 0), dp_shard=8, dp_size=8, tp=1, cp=1, is_main=True)
    runtime = SimpleNamespace(device_type="cuda", parallel="mfsdp")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * mp.GIB))
    log = __import__("logging").getLogger("test_memory_plan")
    with pytest.raises(ConfigError, match="set distributed.mfsdp.zero_dp_strategy=3"):
        mp.check_run(cfg, recipe, env, runtime, log)
    with caplog.at_level("INFO", logger="test_memory_plan"):
        mp.check_run(cfg, recipe, env, SimpleNamespace(device_type="cpu", parallel="fsdp2"), log)
        assert caplog.text == ""  # CPU runs have no plan
        warned = validated_config("gpt_1b", ["checkpoint.path=unused", *LLAMA_8B, "training.memory_plan=warn"])
        mp.check_run(warned, recipe, env, runtime, log)
    assert "memory plan per GPU" in caplog.text and "does not fit" not in caplog.text
    assert "set distributed.mfsdp.zero_dp_strategy=3" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="test_memory_plan"):  # a model the plan cannot build: told, not fatal
        mp.check_run(cfg, SimpleNamespace(block_shape=recipe.block_shape, build_model=None), env, runtime, log)
    assert "memory plan: not estimated (TypeError" in caplog.text


def test_the_plan_counts_parameters_without_allocating_or_initializing_them(monkeypatch):
    from core.layers import weight_init

    def drawn(*args):
        raise AssertionError("a weight was initialized for the plan")

    monkeypatch.setattr(weight_init, "param_generator", drawn)  # a model on the meta device draws no values
    cfg = validated_config("llama_sft", ["checkpoint.path=unused", *CHATS, "finetune.mode=lora"])
    params = mp.count_parameters(get_recipe(cfg.recipe)(cfg), cfg)
    assert params.total == 8_034_979_840 and params.trained == 4_718_592 and params.blocks_trained == "some"
    h, f, kv = 4096, 14336, 1024
    assert params.unit == h * (h + 2 * kv) + h * h + 3 * f * h + 2 * h + 8 * (h + (h + 2 * kv)) + 8 * (h + h)
