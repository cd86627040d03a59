"""Every number in a config is range-checked when the config is validated, before any work, with the key,
the value and the allowed range named (no numeric field of any schema is left without a rule); and
preprocessing errors name the file and the position."""

from __future__ import annotations

import dataclasses
import glob
import typing
from pathlib import Path

import pytest

from core.config.errors import ConfigError
from core.config.ranges import Int, Numbers, Real, rules_of
from tests.support.helpers import CONFIGS, REPO, compose_config, run_python, validated_config

INT32 = "2**31 - 1"

BAD = [
    (
        "vit_sanity",
        "training.micro_batch_size=-4",
        f"training.micro_batch_size=-4: expected an integer 1 <= micro_batch_size <= {INT32}",
    ),
    ("vit_sanity", "training.micro_batch_size=0", "training.micro_batch_size=0: expected an integer 1 <="),
    ("vit_sanity", "training.steps=0", "training.steps=0: expected an integer 1 <= steps <="),
    (
        "vit_sanity",
        "training.steps=99999999999",
        f"training.steps=99999999999: expected an integer 1 <= steps <= {INT32}",
    ),
    (
        "vit_sanity",
        "training.epochs=2",
        "training.steps=300 and training.epochs=2 both give the run's length: give one",
    ),
    ("vit_sanity", "training.steps=null", "training.steps or training.epochs: give one"),
    (
        "vit_sanity",
        "training.val_every_n_epochs=-1",
        f"training.val_every_n_epochs=-1: expected an integer 0 <= val_every_n_epochs <= {INT32} (0: not by epoch)",
    ),
    ("vit_sanity", "training.global_batch_size=0", "training.global_batch_size=0: expected an integer 1 <="),
    ("vit_sanity", "training.log_every_n_steps=0", "training.log_every_n_steps=0: expected an integer 1 <="),
    ("vit_sanity", "training.val_every_n_steps=-1", "training.val_every_n_steps=-1: expected an integer 0 <="),
    ("vit_sanity", "training.limit_val_batches=-2", "training.limit_val_batches=-2: expected an integer -1 <="),
    ("vit_sanity", "training.profile.steps=0", "training.profile.steps=0: expected an integer 1 <= steps <="),
    ("vit_sanity", "optim.lr=0", "optim.lr=0.0: expected 1e-30 <= lr <= 10"),
    ("vit_sanity", "optim.lr=-1", "optim.lr=-1.0: expected 1e-30 <= lr <= 10"),
    ("vit_sanity", "optim.lr=nan", "optim.lr=nan: expected 1e-30 <= lr <= 10"),
    ("vit_sanity", "optim.lr=inf", "optim.lr=inf: expected 1e-30 <= lr <= 10"),
    ("vit_sanity", "optim.lr=1e300", "optim.lr=1e+300: expected 1e-30 <= lr <= 10"),
    ("vit_sanity", "optim.lr=1e-320", "optim.lr=1e-320: expected 1e-30 <= lr <= 10"),  # 0 in fp32
    ("vit_sanity", "optim.weight_decay=-0.1", "optim.weight_decay=-0.1: expected 0 <= weight_decay <= 10"),
    ("vit_sanity", "optim.eps=0", "optim.eps=0.0: expected 1e-30 <= eps <= 1"),
    ("vit_sanity", "optim.eps=1e-320", "optim.eps=1e-320: expected 1e-30 <= eps <= 1"),  # a NaN loss at step 2
    ("vit_sanity", "optim.betas=[0.9,1.0]", "optim.betas=[0.9, 1.0]: expected two numbers, each 0 <= betas < 1"),
    ("vit_sanity", "optim.betas=[0.9]", "optim.betas=[0.9]: expected two numbers, each 0 <= betas < 1"),
    (
        "vit_sanity",
        "optim.max_grad_norm=nan",
        "optim.max_grad_norm=nan: expected 0 <= max_grad_norm <= 1e6 (0: no clipping)",
    ),
    ("vit_sanity", "scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio=2.0: expected 0 <= min_lr_ratio <= 1"),
    ("vit_sanity", "scheduler.warmup_steps=-1", "scheduler.warmup_steps=-1: expected an integer 0 <= warmup_steps <="),
    ("vit_sanity", "distributed.tp=0", "distributed.tp=0: expected an integer 1 <= tp <="),
    (
        "vit_sanity",
        "distributed.dp_shard=0",
        f"distributed.dp_shard=0: expected -1 or an integer 1 <= dp_shard <= {INT32} (-1: what is left)",
    ),
    (
        "vit_sanity",
        "distributed.timeout_minutes=inf",
        "distributed.timeout_minutes=inf: expected 0.1 <= timeout_minutes <= 10080",
    ),
    (
        "vit_sanity",
        "distributed.timeout_minutes=1e300",
        "distributed.timeout_minutes=1e+300: expected 0.1 <= timeout_minutes <= 10080",
    ),
    (
        "vit_sanity",
        "distributed.timeout_minutes=1e-300",  # torchrun: "timed out after 0ms"
        "distributed.timeout_minutes=1e-300: expected 0.1 <= timeout_minutes <= 10080",
    ),
    (
        "vit_sanity",
        "distributed.ddp.bucket_cap_mb=0",
        "distributed.ddp.bucket_cap_mb=0.0: expected 0 < bucket_cap_mb <=",
    ),
    ("vit_sanity", "precision.fp8.amax_history_len=0", "precision.fp8.amax_history_len=0: expected an integer 1 <="),
    ("vit_sanity", "precision.fp8.margin=200", "precision.fp8.margin=200: expected an integer 0 <= margin <= 127"),
    (
        "vit_sanity",
        "checkpoint.write_threads=0",
        "checkpoint.write_threads=0: expected an integer 1 <= write_threads <= 1024",
    ),
    ("vit_sanity", "checkpoint.save_every_n_steps=-5", "checkpoint.save_every_n_steps=-5: expected an integer 0 <="),
    ("vit_sanity", "checkpoint.keep_last_n=0", "checkpoint.keep_last_n=0: expected -1 or an integer 1 <= keep_last_n"),
    (
        "vit_sanity",
        "seed=-1",
        f"seed=-1: expected an integer 0 <= seed <= {INT32} (each rank seeds numpy with seed + rank)",
    ),
    ("vit_sanity", "predict.micro_batch_size=0", "predict.micro_batch_size=0: expected an integer 1 <="),
    ("vit_sanity", "data.num_workers=-1", "data.num_workers=-1: expected an integer 0 <= num_workers <= 1024"),
    ("vit_sanity", "data.hflip=2", "data.hflip=2.0: expected 0 <= hflip <= 1"),
    (
        "vit_sanity",
        "data.std=[0,0,0]",
        "data.std=[0.0, 0.0, 0.0]: expected one or more numbers, each 0.001 <= std <= 1",
    ),
    (
        "vit_sanity",
        "data.std=[1e-320,1e-320,1e-320]",
        "data.std=[1e-320, 1e-320, 1e-320]: expected one or more numbers, each 0.001 <= std <= 1",
    ),
    ("vit_sanity", "data.std=[]", "data.std=[]: expected one or more numbers, each 0.001 <= std <= 1"),
    (
        "vit_sanity",
        "data.mean=[nan,0,0]",
        "data.mean=[nan, 0.0, 0.0]: expected one or more numbers, each 0 <= mean <= 1",
    ),
    (
        "vit_sanity",
        "data.mean=[0.5,0.5]",
        "data.mean=[0.5, 0.5] and data.std=[0.5, 0.5, 0.5]: expected one value per channel",
    ),
    (
        "vit_sanity",
        "data.train_crop_scale=[-1,5]",
        "data.train_crop_scale=[-1.0, 5.0]: expected two numbers 0.001 <= low <= high <= 1",
    ),
    (
        "vit_sanity",
        "data.train_crop_scale=[1e-320,1e-320]",
        "data.train_crop_scale=[1e-320, 1e-320]: expected two numbers 0.001 <= low <= high <= 1",
    ),
    (
        "vit_sanity",
        "data.train_crop_scale=[0.9,0.5]",
        "data.train_crop_scale=[0.9, 0.5]: expected two numbers 0.001 <= low <= high",
    ),
    (
        "vit_sanity",
        "data.train_crop_ratio=[0,0]",
        "data.train_crop_ratio=[0.0, 0.0]: expected two numbers 0.01 <= low <= high <= 100",
    ),
    ("vit_sanity", "data.val_crop_fraction=0", "data.val_crop_fraction=0.0: expected 0.1 <= val_crop_fraction <= 1"),
    ("vit_sanity", "data.mixup_alpha=-1", "data.mixup_alpha=-1.0: expected 0 <= mixup_alpha <= 100 (0: off)"),
    ("vit_sanity", "model.depth=0", "model.depth=0: expected an integer 1 <= depth <="),
    ("vit_sanity", "model.mlp_ratio=1e300", "model.mlp_ratio=1e+300: expected 0 < mlp_ratio <= 64"),
    ("vit_sanity", "model.hidden_dropout=1.5", "model.hidden_dropout=1.5: expected 0 <= hidden_dropout <= 1"),
    ("vit_sanity", "model.init_std=0", "model.init_std=0.0: expected 1e-6 <= init_std <= 1"),  # torch divides by it
    (
        "vit_sanity",
        "model.layernorm_epsilon=1e-320",
        "model.layernorm_epsilon=1e-320: expected 1e-30 <= layernorm_epsilon <= 1",
    ),
    # Relations of the ViT's sizes (recipes/vit/model.py), refused before the model is built.
    (
        "vit_sanity",
        "model.mlp_ratio=1e-9",
        "model.mlp_ratio=1e-09 and model.hidden_size=96: the MLP's width int(hidden_size * mlp_ratio) is 0; "
        "expected at least 1",
    ),
    (
        "vit_sanity",
        "model.num_heads=5",
        "model.hidden_size=96 and model.num_heads=5: expected hidden_size divisible by num_heads",
    ),
    (
        "vit_sanity",
        "model.img_size=8",
        "model.img_size=8 and model.patch_size=7: expected img_size divisible by patch_size",
    ),
    ("vit_sanity", "checkpoint.save_on_signals=[SIGKILL]", "checkpoint.save_on_signals: SIGKILL: cannot be caught"),
    (
        "vit_sanity",
        "checkpoint.save_on_signals=[SIGTERM,sigstop]",
        "checkpoint.save_on_signals: sigstop: cannot be caught",
    ),
    (
        "vit_sanity",
        "checkpoint.save_on_signals=[SIGCLD]",  # an alias of SIGCHLD
        "checkpoint.save_on_signals: SIGCLD: sent whenever a child process ends",
    ),
    ("vit_sanity", "checkpoint.save_on_signals=[SIGSEGV]", "checkpoint.save_on_signals: SIGSEGV: a fault of"),
    ("gpt_sanity", "model.seq_length=0", "model.seq_length=0: expected an integer 1 <= seq_length <="),
    ("gpt_sanity", "model.norm_epsilon=nan", "model.norm_epsilon=nan: expected 1e-30 <= norm_epsilon <= 1"),
    ("gpt_sanity", "model.init_std=0", "model.init_std=0.0: expected 1e-6 <= init_std <= 1"),
    # Relations of the GPT's sizes (recipes/gpt/model.py) and distributed.tp, refused before the model is built.
    (
        "gpt_sanity",
        "model.num_attention_heads=3",
        "model.hidden_size=128 and model.num_attention_heads=3: expected hidden_size divisible by num_attention_heads",
    ),
    (
        "gpt_sanity",
        "model.hidden_size=132",
        "model.hidden_size=132 and model.num_attention_heads=4: the head size 33 must be even",
    ),
    (
        "gpt_sanity",
        "model.num_query_groups=3",
        "model.num_attention_heads=4 and model.num_query_groups=3: expected num_attention_heads divisible by "
        "num_query_groups",
    ),
    (
        "gpt_sanity",
        "distributed.tp=4",
        "model.num_query_groups=2 is not divisible by distributed.tp=4: each tensor-parallel rank holds an equal part",
    ),
    (
        "gpt_sanity",
        "model.ffn_hidden_size=353 distributed.tp=2",
        "model.ffn_hidden_size=353 is not divisible by distributed.tp=2",
    ),
    ("gpt_sanity", "distributed.tp=0", "distributed.tp=0: expected an integer 1 <= tp <="),  # its own rule, not a % 0
    ("gpt_sanity", "model.rotary_base=1", "model.rotary_base=1.0: expected 1 < rotary_base <= 1e12"),
    (
        "gpt_sanity",
        "generate.temperature=1e-320",
        "generate.temperature=1e-320: expected 0.001 <= temperature <= 100 (for the most likely token: "
        "generate.greedy=true)",
    ),
    ("gpt_sanity", "generate.top_p=0", "generate.top_p=0.0: expected 0 < top_p <= 1"),
    (
        "gpt_sanity",
        "data.val_num_samples=-5",
        f"data.val_num_samples=-5: expected an integer 1 <= val_num_samples <= {INT32}",
    ),
    (
        "gpt_sanity",
        "data.weights=[-1.0]",
        "data.weights=[-1.0]: expected one or more numbers, each 0 <= weights <= 1e15",
    ),
    ("gpt_sanity", "data.weights=[nan]", "data.weights=[nan]: expected one or more numbers, each 0 <= weights <= 1e15"),
    ("gpt_sanity", "data.weights=[0.0]", "data.weights=[0.0]: expected a sum > 0"),
    (
        "gpt_sanity",
        "data.weights=[1,2]",  # Megatron-Core's AssertionError after the model build otherwise
        "data.weights=[1.0, 2.0]: data.format=text makes one dataset of all data.text_files; expected one weight",
    ),
    (
        "gpt_sanity",
        "data=gpt_indexed data.prefixes=[a,b] data.weights=[1]",
        "data.weights=[1.0] and data.prefixes=['a', 'b']: expected one weight per prefix",
    ),
    ("gpt_sanity", "data.split=abc", "data.split=abc: expected 1 to 3 numbers >= 0 separated by commas"),
    ("gpt_sanity", "data.split='0,0,0'", "data.split=0,0,0: expected 1 to 3 numbers >= 0 separated by commas"),
    ("mnist_pretrain", "model.latent_size=0", "model.latent_size=0: expected an integer 1 <= latent_size <="),
    (
        "mnist_pretrain",
        "data.val_size=0",
        f"data.val_size=0: expected an integer 1 <= val_size <= {INT32} (null: 1/12 of the training file)",
    ),
    (
        "mnist_pretrain",
        f"data.split_seed={10**23}",
        f"data.split_seed={10**23}: expected an integer 0 <= split_seed <= {INT32}",
    ),
]


@pytest.mark.parametrize("config,override,message", BAD, ids=[o for _, o, _ in BAD])
def test_a_number_out_of_range_is_refused_naming_its_key(config, override, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        validated_config(config, [f"checkpoint.path={tmp_path}", *override.split()])
    assert message in str(error.value)


def test_an_mnist_validation_set_that_leaves_no_training_samples_is_refused():
    from recipes.mnist.recipe import MNISTRecipe

    recipe = MNISTRecipe(validated_config("mnist_pretrain", ["checkpoint.path=unused", "data.val_size=4000"]))
    with pytest.raises(ConfigError, match=r"data.val_size=4000: expected 1 <= val_size < 4000 \(the training file"):
        recipe.split("val")  # the shipped training file holds 4,000 samples


def _schemas() -> list[type]:
    """Every config schema: the TrainConfig tree and each recipe's model and data schemas."""
    from core.config.schema import TrainConfig
    from recipes.registry import all_recipes

    found, todo = [], [TrainConfig]
    for recipe in all_recipes():
        todo += [recipe.model_schema, recipe.data_schema]
    while todo:
        schema = todo.pop()
        if schema not in found:
            found.append(schema)
        todo += [hint for hint in typing.get_type_hints(schema).values() if dataclasses.is_dataclass(hint)]
    return found


def _ranged_fields(schema: type) -> set[str]:
    """The fields that must have a rule: all of a core schema's, and of a recipe schema that has a RANGES table of its
    own (a recipe's table is optional: without one only the types of its own fields are checked); the fields a
    recipe schema takes from the core's ModelConfig / DataConfig always."""
    from core.config.schema import DataConfig, ModelConfig

    bases = [base for base in (ModelConfig, DataConfig) if issubclass(schema, base) and schema is not base]
    own_table = any("RANGES" in vars(cls) for cls in schema.__mro__ if cls not in (*bases, object))
    fields = {f.name for f in dataclasses.fields(schema)}
    if not bases or own_table:
        return fields
    return {f.name for base in bases for f in dataclasses.fields(base)}


def _numeric_kind(hint) -> str | None:
    """The kind of a field of numbers (Optional or not): int, float or list; None for any other field."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]  # Optional[X]
    if typing.get_origin(hint) is list and typing.get_args(hint)[0] in (int, float):
        return "list"
    return {int: "int", float: "float"}.get(hint)  # bool and IntEnum fields are closed choices, not numbers


@pytest.mark.parametrize("schema", _schemas(), ids=lambda schema: schema.__name__)
def test_every_numeric_field_has_a_range_rule_and_every_rule_a_field(schema):
    """A new numeric key cannot be forgotten: its schema's RANGES table (or a parent's) must give it a rule of
    its kind (Int for an int, Real for a float, Numbers for a list of numbers)."""
    hints, fields, rules = typing.get_type_hints(schema), [f.name for f in dataclasses.fields(schema)], rules_of(schema)
    assert set(rules) <= set(fields), f"{schema.__name__}: rules for no field: {sorted(set(rules) - set(fields))}"
    for name in sorted(_ranged_fields(schema)):
        kind = _numeric_kind(hints[name])
        if kind is None:
            continue
        rule = rules.get(name)
        assert rule is not None, f"{schema.__name__}.{name} has no rule in a RANGES table (core/config/ranges.py)"
        expected = {"int": Int, "float": Real, "list": Numbers}[kind]
        assert isinstance(rule, expected) and (kind != "float" or not isinstance(rule, Int)), (
            f"{schema.__name__}.{name}: a {kind} field with the rule {rule}"
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_at_the_lowest_accepted_divisors_the_arithmetic_stays_finite(dtype):
    """optim.eps, the norms' epsilons, data.std and init_std are divided by, optim.lr scales every step; at their
    lower bounds the arithmetic stays finite in fp32 and bf16, where the denormal 1e-320 that the bounds refuse
    gives NaN or inf."""
    import math

    import torch
    import torch.nn.functional as F

    from core.config.schema import OptimConfig
    from core.layers.weight_init import standard_rule
    from recipes.gpt.config import GPTModelConfig
    from recipes.vit.config import ImageDataConfig, ViTModelConfig

    dtype = getattr(torch, dtype)

    def adamw_step(eps: float, lr: float = 1e-3) -> torch.Tensor:  # a zero gradient, then one whose square is 0
        weight = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        optimizer = torch.optim.AdamW([weight], lr=lr, eps=eps)
        for grad in (0.0, 1e-30):
            weight.grad = torch.full_like(weight, grad)
            optimizer.step()
        return weight.detach()

    optim = rules_of(OptimConfig)
    assert torch.isfinite(adamw_step(optim["eps"].low)).all() and not torch.isfinite(adamw_step(1e-320)).all()
    # The smallest lr: finite, and the weights stay as they are (what tests that load weights and step rely on).
    assert torch.equal(adamw_step(optim["eps"].low, lr=optim["lr"].low), torch.ones(4, dtype=dtype))

    constant = torch.ones(2, 8, dtype=dtype)  # a variance of 0
    for norm_eps in (rules_of(ViTModelConfig)["layernorm_epsilon"].low, rules_of(GPTModelConfig)["norm_epsilon"].low):
        assert torch.isfinite(F.layer_norm(constant, (8,), eps=norm_eps)).all()
        assert torch.isfinite(F.rms_norm(constant - 1, (8,), eps=norm_eps)).all()
    assert not torch.isfinite(F.layer_norm(constant, (8,), eps=1e-320)).all()

    # The farthest pixel from the mean over the smallest std, summed over a 16 x 16 x 3 patch with weights of 0.04
    # (2 init_std): within reach of even fp16 (65504).
    std = rules_of(ImageDataConfig)["std"].each.low
    pixels = torch.ones(1, 768) / std
    assert torch.isfinite(F.linear(pixels.to(dtype), torch.full((1, 768), 0.04, dtype=dtype))).all()
    assert pixels.max() * 768 * 0.04 < torch.finfo(torch.float16).max
    assert not torch.isfinite(torch.ones(1) / torch.tensor(1e-320, dtype=torch.float32)).all()

    # GPT's output projections are drawn with init_std / sqrt(2 num_layers): still > 0 at the most layers (the
    # ViT's bound is the same, unscaled).
    assert rules_of(ViTModelConfig)["init_std"].low == rules_of(GPTModelConfig)["init_std"].low
    rule = rules_of(GPTModelConfig)
    weight = torch.empty(4, 4, dtype=dtype)
    standard_rule(rule["init_std"].low / math.sqrt(2 * rule["num_layers"].high))("w", weight, torch.Generator())
    assert torch.isfinite(weight).all() and weight.abs().max() > 0
    with pytest.raises(ZeroDivisionError):
        standard_rule(0.0)("w", weight, torch.Generator())


def test_a_number_out_of_range_ends_the_command_line_run_with_one_line(tmp_path):
    proc = run_python(
        REPO / "train.py",
        "--config-name",
        "vit_sanity",
        "optim.lr=1e300",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].endswith("config error: optim.lr=1e+300: expected 1e-30 <= lr <= 10"), output
    assert "Traceback" not in output and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "config", sorted(Path(p).stem for p in glob.glob(str(CONFIGS / "*.yaml")) if Path(p).stem != "train_defaults")
)
def test_the_shipped_configs_pass(config, tmp_path):
    """Every shipped config validates as it is, given only what it asks the user for (`???`, e.g. esm2_finetune's
    checkpoint.init_from: the user's pretrained weights; llama_sft's data.train_path and data.tokenizer: the user's
    chat rows and Llama folder)."""
    from omegaconf import OmegaConf

    asked = sorted(OmegaConf.missing_keys(compose_config(config, [f"checkpoint.path={tmp_path}"])))
    assert set(asked) <= {"checkpoint.init_from", "data.train_path", "data.tokenizer"}, (
        f"{config} leaves {asked} to the user"
    )
    validated_config(config, [f"checkpoint.path={tmp_path}", *(f"{key}={tmp_path}/given" for key in asked)])


def test_preprocessing_names_the_file_and_position_of_binary_input(tmp_path):
    from recipes.gpt.preprocess import read_documents

    text = tmp_path / "notes.txt"
    text.write_bytes(b"a paragraph\n\nanother\n\xff\xfe binary")
    with pytest.raises(ValueError, match=rf"{text}:4: not UTF-8 text \(byte 21 of the file"):
        list(read_documents(text))
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(b'{"text": "fine"}\n{"text": "\xc3("}\n')
    with pytest.raises(ValueError, match=rf"{lines}:2: not UTF-8 text"):
        list(read_documents(lines))


def test_an_mnist_image_size_the_files_do_not_hold_is_a_config_error():
    from recipes.mnist.data import build_mnist_split

    cfg = validated_config(
        "mnist_pretrain", ["model.image_size=27", "checkpoint.path=unused"]
    )  # the model takes any size
    with pytest.raises(ConfigError, match=r"model.image_size=27, but the images under data.root=.* are 28 x 28"):
        build_mnist_split(cfg.data, "train", cfg.model.image_size)
