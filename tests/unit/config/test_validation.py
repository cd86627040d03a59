"""Bad configs fail before any work, with a message that names the key."""

from __future__ import annotations

import itertools
import subprocess

import pytest
import torch

from core.config.errors import ConfigError
from core.config.validation import validate
from core.data.sampling import GlobalBatchSampler, accumulation_steps
from core.distributed.env import mesh_shape
from tests.support.helpers import REPO, compose_config, run_python


def run_train(*overrides: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_python("train.py", "--config-name", "vit_sanity", *overrides, cwd=REPO, timeout=timeout)


@pytest.mark.parametrize(
    "override,code,message",
    [
        # unknown key: our check, with the closest key
        ("optim.lrr=1", 2, "config error: unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
        # wrong type: Hydra's merge into the schema, its error shown as one line naming the override (it was Hydra's
        # message over several lines, exit code 1)
        (
            "training.steps=abc",
            2,
            "config error: training.steps=abc: Value 'abc' of type 'str' could not be converted to Integer\n",
        ),
        (
            "model.hidden_size=big",
            2,
            "config error: model.hidden_size=big: Value 'big' of type 'str' could not be converted to Integer\n",
        ),
        # an option a group lacks: the options it has
        (
            "distributed=nonexistent",
            2,
            "config error: distributed=nonexistent: no such option of distributed; choose one "
            "of auto, ddp, fsdp2, mfsdp\n",
        ),
        # forced new keys (+key=...) pass Hydra's merge: caught by our validation
        ("+optim.foo=1", 2, "config error: unknown key 'optim.foo'"),
        ("+model.dropout=0.1", 2, "config error: unknown key 'model.dropout'; did you mean 'model.hidden_dropout'?"),
        (
            "distributed.mfsdp.zero_dp_strategy=x",
            2,
            "config error: distributed.mfsdp.zero_dp_strategy=x: Invalid value 'x', expected one of [no_shard, optim, "
            "optim_grads, optim_grads_params]\n",
        ),
    ],
)
def test_cli_rejects_bad_key_or_type(override, code, message, tmp_path):
    """Each bad override stops train.py with one line naming it and exit code 2 (our config check, or Hydra's merge
    into the schema), never a traceback, before anything runs."""
    proc = run_train(override, f"hydra.run.dir={tmp_path}")
    output = proc.stderr + proc.stdout
    assert message in output, output[-2000:]
    assert proc.returncode == code, output[-2000:]
    assert "Traceback" not in output and "HYDRA_FULL_ERROR" not in output, output[-2000:]
    said = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warnings.warn" not in line]
    assert len(said) <= 1, proc.stderr[-2000:]  # one line (or none: a check after composing logs it on stdout)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing ran


def test_validate_names_missing_value():
    cfg = compose_config("vit_sanity", ["checkpoint.path=x", "optim.lr=???"])
    with pytest.raises(ConfigError, match="optim.lr"):
        validate(cfg)


def test_mesh_must_cover_world():
    assert mesh_shape(8, 1, -1, 2) == (1, 4, 1, 2)
    assert mesh_shape(8, 2, 2, 2) == (2, 2, 1, 2)
    assert mesh_shape(8, 1, -1, 1, cp=4) == (1, 2, 4, 1)  # (dp_outer, dp_shard, cp, tp)
    assert mesh_shape(8, 2, -1, 2, cp=2) == (2, 1, 2, 2)
    with pytest.raises(ConfigError, match="world size is 4"):
        mesh_shape(4, 1, 3, 1)
    with pytest.raises(ConfigError, match=r"dp_outer x dp_shard x cp x tp = 1 x 2 x 3 x 1 = 6"):
        mesh_shape(4, 1, 2, 1, cp=3)
    with pytest.raises(ConfigError, match="distributed.cp=-1 may be|only one of"):
        mesh_shape(4, 1, -1, 1, cp=-1)
    with pytest.raises(ConfigError, match="not divisible"):
        mesh_shape(6, 1, -1, 4)
    with pytest.raises(ConfigError, match="positive"):
        mesh_shape(2, 0, 2, 1)


def test_global_batch_must_divide():
    assert accumulation_steps(64, 8, 2) == 4
    with pytest.raises(ValueError, match="global_batch_size=60 is not divisible"):
        accumulation_steps(60, 8, 2)


def test_cli_mesh_error_is_clear(tmp_path):
    proc = run_train("distributed.dp_shard=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "world size is 1" in proc.stdout + proc.stderr


def test_cli_mfsdp_on_cpu_is_refused(tmp_path):
    proc = run_train("distributed=mfsdp", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "mfsdp needs CUDA" in proc.stdout + proc.stderr


def test_cli_fp8_without_transformer_engine_is_refused(tmp_path):
    proc = run_train("precision=fp8", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "precision.fp8.enabled needs TransformerEngine" in proc.stdout + proc.stderr


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_vit_base_runs_as_typed_on_1_to_8_gpus(gpus):
    """The README's ViT command (distributed.dp_shard=NGPU), composed and split as a run on NGPU processes splits
    it: the mesh the run builds, the accumulation it works out and each rank's sampler. Every rank trains
    micro-batches of 256 (the fast size), and one step's micro-batches over all ranks are the global batch's
    samples, each once."""
    cfg = validate(
        compose_config("vit_base_patch16_224", [f"distributed.dp_shard={gpus}", "checkpoint.path=./ckpts/vit"])
    )
    t, d = cfg.training, cfg.distributed
    dp_outer, dp_shard, _, tp = mesh_shape(gpus, d.dp_outer, d.dp_shard, d.tp, d.cp)
    assert (dp_outer * dp_shard, tp) == (gpus, 1)
    accumulation = accumulation_steps(t.global_batch_size, t.micro_batch_size, dp_outer * dp_shard)
    step = []
    for rank in range(gpus):
        micro_batches = itertools.islice(
            GlobalBatchSampler(t.micro_batch_size, t.global_batch_size, gpus, rank), accumulation
        )
        for micro_batch in micro_batches:
            assert len(micro_batch) == 256
            step += micro_batch
    assert sorted(step) == list(range(t.global_batch_size))
    assert accumulation == 8 // gpus


# --- the recipe contract (recipes/base.py) and the registry (recipes/registry.py) --------------------------------


def test_recipes_are_the_folders_with_a_recipe_py_and_an_unknown_one_lists_them():
    from recipes.registry import get_recipe, predict_configs, recipe_names

    names = recipe_names()
    assert {"esm2", "gpt", "mnist", "vit"} <= set(names) and list(names) == sorted(names)
    assert all(get_recipe(name).name == name for name in names)
    assert {name: predict_configs()[name] for name in ("vit", "mnist", "gpt", "esm2")} == {
        "vit": "vit_predict",
        "mnist": "mnist_predict",
        "gpt": "gpt_sanity",
        "esm2": "esm2_sanity",
    }
    with pytest.raises(ConfigError, match=rf"^recipe: unknown recipe 'plm'; known: {', '.join(names)}$"):
        get_recipe("plm")


def _minimal_recipe(name: str = "tiny"):
    """A recipe with the four required hooks and nothing else."""
    from recipes.base import Datasets, Recipe

    class Tiny(Recipe):
        def build_model(self, layers, device):
            return torch.nn.Linear(2, 1)

        def unit_modules(self, layers):
            return [torch.nn.Linear]

        def build_datasets(self):
            return Datasets([{"x": torch.zeros(2)}], None)

        def forward(self, model, batch, training):
            loss = model(batch["x"])[:, 0].square()
            return {"loss": loss, "count": torch.ones_like(loss)}

    Tiny.name = name
    return Tiny


def test_a_recipe_needs_four_hooks_and_has_defaults_for_the_rest():
    from recipes.base import Recipe

    class Half(Recipe):
        name = "half"

        def build_model(self, layers, device):
            return torch.nn.Linear(2, 1)

    with pytest.raises(TypeError) as error:
        Half(None)
    assert all(hook in str(error.value) for hook in ("unit_modules", "build_datasets", "forward"))
    recipe = _minimal_recipe()(None)
    batch = {"x": torch.zeros(5, 2), "y": torch.zeros(5)}
    assert recipe.loss_count(batch).item() == 5.0 and recipe.loss_count(batch).dim() == 0  # one term per sample
    assert recipe.tokens_per_sample() is None and recipe.flops_per_sample() is None and recipe.work(batch) is None
    assert recipe.validation_metrics() == ("loss",) and recipe.test_configs() == {"tiny": ("tiny", ())}
    assert recipe.model_schema.__name__ == "ModelConfig" and recipe.data_schema.__name__ == "DataConfig"


def test_a_tool_names_the_opt_in_protocol_a_recipe_lacks():
    from recipes.base import GENERATION, PREDICTION, require
    from recipes.registry import get_recipe

    with pytest.raises(
        ConfigError,
        match=r"^predict.py needs a recipe with split and predict; the tiny recipe has no "
        r"split and no predict \(recipes/base.py\)$",
    ):
        require(_minimal_recipe(), PREDICTION, "predict.py")
    for name in ("vit", "mnist", "gpt", "esm2"):
        require(get_recipe(name), PREDICTION, "predict.py")
    require(get_recipe("gpt"), GENERATION, "generate.py")
    with pytest.raises(
        ConfigError,
        match="^generate.py needs a recipe with tokenizer and vocab_size and new_kv_cache "
        "and next_logits; the esm2 recipe has no tokenizer and no vocab_size and no "
        "new_kv_cache and no next_logits",
    ):
        require(get_recipe("esm2"), GENERATION, "generate.py")
