"""Hugging Face folders and weight files as users bring them: what transformers' own save_pretrained writes, folders
whose config.json and weights disagree, quantized weights, output paths that exist, and paths that a pasted command
line must not turn into shell code. Each is imported right or refused with the file or tensor named."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint
from core.checkpointing.hf_folders import override
from core.checkpointing.layout import CheckpointError, verify
from core.checkpointing.weights import load_weights_file
from recipes.esm2 import hf as esm_hf

ESM = {
    "vocab_size": 33,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "position_embedding_type": "rotary",
    "token_dropout": True,
    "pad_token_id": 1,
    "mask_token_id": 32,
}


def saved_by_transformers(folder: Path, **changes) -> torch.nn.Module:
    from transformers import EsmConfig, EsmForMaskedLM

    torch.manual_seed(0)
    model = EsmForMaskedLM(EsmConfig(**(ESM | changes)))
    model.save_pretrained(folder)
    return model


def test_an_esm_folder_saved_by_transformers_imports_with_its_weights(tmp_path, capsys):
    model = saved_by_transformers(tmp_path / "hf")
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    # transformers writes its legacy LayerNorm names for a fresh model (and reads them back): they are the weights
    legacy = [k for k in stored if k.endswith((".gamma", ".beta"))]
    assert legacy, "this transformers writes weight/bias: the legacy-name case is not exercised"
    out = tmp_path / "odd dir $(touch PWNED),x=1"
    out.mkdir()
    checkpoint.main(["from-hf", str(tmp_path / "hf"), str(out / "w.safetensors"), "--unfused-qkv"])
    weights = load_weights_file(out / "w.safetensors")
    layer = model.esm.encoder.layer[1]
    assert torch.equal(
        weights["layers.1.self_attention.layernorm_qkv.layer_norm_weight"], layer.attention.LayerNorm.weight
    )
    assert torch.equal(weights["layers.1.layernorm_mlp.layer_norm_bias"], layer.LayerNorm.bias)
    assert torch.equal(weights["layers.1.self_attention.layernorm_qkv.key_weight"], layer.attention.self.key.weight)
    # The printed command line: one shell word per setting, each read back by Hydra as the path itself.
    printed = capsys.readouterr().out.splitlines()[-1].split("with: ", 1)[1]
    words = shlex.split(printed)
    assert "model.fuse_qkv_params=false" in words
    (init,) = [w for w in words if w.startswith("checkpoint.init_from=")]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert OverridesParser.create().parse_override(init).value() == str(out / "w.safetensors")
    assert override("checkpoint.init_from", out / "w.safetensors") in printed


def write_folder(folder: Path, weights: dict, config: dict) -> None:
    folder.mkdir()
    save_file({k: v.clone().contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"num_hidden_layers": 1}, "config.json gives 1 layers, the weights hold 2"),
        ({"num_hidden_layers": (1 << 20) - 1}, "config.json gives 1048575 layers, the weights hold 2"),
        (
            {"hidden_size": 32},
            r"other shape: esm.embeddings.word_embeddings.weight \(33, 16\) \(config.json: \(33, 32\)\)",
        ),
        ({"rope_theta": float("inf")}, "rope_theta=inf; not an ESM-2 model"),
        ({"junk": True}, r"unexpected: some.adapter.weight"),
        ({"int8": True}, r"not floating point \(quantized\?\): esm.encoder.layer.0.attention.output.dense.weight"),
    ],
)
def test_esm_weights_that_do_not_fit_config_json_are_refused_by_name(tmp_path, change, named):
    model = saved_by_transformers(tmp_path / "base")
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    if change.pop("junk", False):
        weights["some.adapter.weight"] = torch.ones(2)
    if change.pop("int8", False):
        name = "esm.encoder.layer.0.attention.output.dense.weight"
        weights[name] = (weights[name] * 1000).to(torch.int8)
    write_folder(tmp_path / "hf", weights, ESM | {"model_type": "esm"} | change)
    with pytest.raises(SystemExit, match=named):
        checkpoint.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "w.safetensors")])
    assert not (tmp_path / "w.safetensors").exists()


def test_to_hf_checks_a_weights_file_against_the_config_it_is_given(tmp_path):
    model = saved_by_transformers(tmp_path / "hf")
    m = esm_hf.check_esm2_config(json.loads((tmp_path / "hf" / "config.json").read_text()), tmp_path)
    ours = esm_hf.from_hf({k: v.detach() for k, v in model.state_dict().items()}, m)
    fewer = esm_hf.check_esm2_config(ESM | {"model_type": "esm", "num_hidden_layers": 1}, tmp_path)
    with pytest.raises(ValueError, match="model.num_layers=1, the weights hold 2 layers"):
        esm_hf.to_hf(ours, fewer)
    narrower = esm_hf.check_esm2_config(ESM | {"model_type": "esm", "intermediate_size": 24}, tmp_path)
    with pytest.raises(
        ValueError,
        match=r"do not fit the run's model config.*other shape: .*"
        r"esm.encoder.layer.0.intermediate.dense.weight \(32, 16\)",
    ):
        esm_hf.to_hf(ours, narrower)
    gpt_like = {"embedding.weight": torch.zeros(40, 16), "layers.0.x": torch.zeros(1), "layers.1.x": torch.zeros(1)}
    with pytest.raises(ValueError, match="not an ESM-2 model of this config: .* tensors missing"):
        esm_hf.to_hf(gpt_like, m)
    assert set(esm_hf.to_hf(ours, m)) >= set(esm_hf.hf_shapes(m))  # control: the right config converts


def test_outputs_that_exist_are_refused_and_an_hf_folder_is_not_called_a_broken_checkpoint(tmp_path):
    saved_by_transformers(tmp_path / "hf")
    checkpoint.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "step_0")])
    mine = tmp_path / "mine.pt"
    mine.write_text("a user's file")
    for command in ("to-torch", "to-safetensors"):
        with pytest.raises(SystemExit, match=f"{mine} exists; choose a new path"):
            checkpoint.main([command, str(tmp_path / "step_0"), str(mine)])
    inside = next((tmp_path / "step_0").glob("*.distcp"))
    with pytest.raises(SystemExit, match="exists; choose a new path"):
        checkpoint.main(["to-torch", str(tmp_path / "step_0"), str(inside)])
    assert mine.read_text() == "a user's file"
    checkpoint.main(["to-torch", str(tmp_path / "step_0"), str(tmp_path / "new.pt")])  # the checkpoint is intact
    with pytest.raises(
        CheckpointError,
        match="a Hugging Face model folder, not a checkpoint of this tool: convert it "
        "with python checkpoint.py from-hf",
    ):
        verify(tmp_path / "hf")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "hf" / "model.safetensors").read_bytes()[:200])
    with pytest.raises(SystemExit, match=f"{tmp_path / 'cut.safetensors'}: cannot read as safetensors"):
        checkpoint.main(["from-torch", str(tmp_path / "cut.safetensors"), str(tmp_path / "step_x")])


@pytest.mark.parametrize("model_type", ["bert", None, ["llama"]])
def test_from_hf_picks_the_recipe_by_model_type_and_lists_those_it_reads(tmp_path, capsys, model_type):
    """from-hf chooses the recipe whose hf.py declares the folder's model_type (HF_MODEL_TYPES); another one is one
    line naming every model_type a recipe reads, and nothing is written."""
    config = ESM | ({"model_type": model_type} if model_type is not None else {})
    write_folder(tmp_path / "hf", {}, config)
    with pytest.raises(SystemExit) as refused:
        checkpoint.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "w.safetensors")])
    assert refused.value.code == 2 and not (tmp_path / "w.safetensors").exists()
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'hf' / 'config.json'}: model_type={model_type!r}; from-hf "
        "reads model_type 'esm' (the esm2 and esm2_finetune recipes), 'esm2_mean_pooled' (the esm2_finetune recipe) "
        "or 'llama' (the gpt recipe)\n"
    )


def test_gpt_to_hf_checks_a_weights_file_against_the_config_it_is_given():
    from recipes.gpt.hf import from_llama, llama_shapes, to_llama_checked

    m = {
        "vocab_size": 64,
        "hidden_size": 16,
        "ffn_hidden_size": 24,
        "num_layers": 2,
        "num_attention_heads": 2,
        "num_query_groups": 1,
        "tie_embeddings": False,
        "rotary_base": 10000.0,
    }
    torch.manual_seed(0)
    ours = from_llama({k: torch.randn(shape) for k, shape in llama_shapes(m).items()}, m)
    assert set(to_llama_checked(ours, m, 64)) == set(llama_shapes(m))  # control: the right config converts
    with pytest.raises(ValueError, match="model.num_layers=1, the weights hold 2 layers"):
        to_llama_checked(ours, m | {"num_layers": 1}, 64)
    with pytest.raises(
        ValueError,
        match=r"other shape: model.layers.0.mlp.down_proj.weight \(16, 24\) "
        r"\(config.json: \(16, 20\)\)",
    ):
        to_llama_checked(ours, m | {"ffn_hidden_size": 20}, 64)
    with pytest.raises(ValueError, match="not a GPT model of this config: no tensor 'output_layer.weight'"):
        to_llama_checked({k: v for k, v in ours.items() if k != "output_layer.weight"}, m, 64)


def test_a_json_file_of_a_model_folder_must_be_a_small_regular_file(tmp_path):
    """config.json was read whole: a sparse file of 8 GiB (no disk blocks, a few bytes in a tar) filled memory, a
    FIFO blocked. Now each is one ValueError naming the file."""
    import os

    from core.checkpointing.hf_folders import read_json_object
    from tests.support.helpers import within

    with open(tmp_path / "config.json", "wb") as f:
        f.write(b'{"model_type": "esm"')
        f.truncate(8 << 30)
    with pytest.raises(ValueError, match="config.json: it is larger than 67108864 bytes"):
        read_json_object(tmp_path / "config.json")
    os.mkfifo(tmp_path / "adapter_config.json")
    with within(10), pytest.raises(ValueError, match="adapter_config.json: it is a FIFO"):
        read_json_object(tmp_path / "adapter_config.json")
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert read_json_object(tmp_path / "ok.json") == {"a": 1}


def test_one_tensor_of_a_far_layer_counts_one_layer_and_builds_no_table():
    """A config.json of 2**31 - 1 layers and one tensor named after the last: the weights hold one layer, so the
    check refuses them before it lists the tensors 2**31 - 1 layers would need."""
    from recipes.gpt.hf import check_llama_weights

    far = {"model.layers.2147483646.input_layernorm.weight": torch.ones(1)}
    with pytest.raises(ValueError, match="it gives 2147483647 layers, the weights hold 1$"):
        check_llama_weights(far, {"num_layers": 2**31 - 1})
    far = {"esm.encoder.layer.1048574.LayerNorm.weight": torch.ones(1)}
    with pytest.raises(ValueError, match="gives 1048575 layers, the weights hold 1;"):
        esm_hf.check_hf_weights(far, SimpleNamespace(num_layers=1048575))


def sharded(folder: Path, shards: dict[str, dict[str, float]], weight_map: dict[str, str]) -> Path:
    """A folder of safetensors shards (file -> tensor name -> its one value) and the index naming them."""
    folder.mkdir(exist_ok=True)
    for shard, tensors in shards.items():
        save_file({k: torch.full((2,), v) for k, v in tensors.items()}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder / "model.safetensors.index.json"


def test_each_tensor_is_taken_from_the_shard_the_index_names(tmp_path):
    """A shard also holding a tensor the index gives to another shard loaded silently, the last shard's copy
    winning; now only weight_map's shard is read, and a copy it does not name is refused, as is a missing one."""
    from core.checkpointing.hf_folders import read_hf_weights

    given = {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}
    sharded(tmp_path / "ok", {"a.safetensors": {"x": 1, "y": 2}, "b.safetensors": {"z": 3}}, given)
    assert {k: v[0].item() for k, v in read_hf_weights(tmp_path / "ok").items()} == {"x": 1, "y": 2, "z": 3}
    for case, shards, named in [
        (
            "dup",
            {"a.safetensors": {"x": 1, "y": 2}, "b.safetensors": {"x": 0, "z": 3}},
            "b.safetensors holds 'x', but weight_map gives it to a.safetensors",
        ),
        (
            "extra",
            {"a.safetensors": {"x": 1, "y": 2, "w": 4}, "b.safetensors": {"z": 3}},
            "a.safetensors holds 'w', but weight_map does not name it",
        ),
        (
            "lost",
            {"a.safetensors": {"x": 1}, "b.safetensors": {"z": 3}},
            "weight_map gives 'y' to a.safetensors, which does not hold it",
        ),
    ]:
        index = sharded(tmp_path / case, shards, given)
        with pytest.raises(ValueError, match=re.escape(f"{index}: {named}; nothing was imported")):
            read_hf_weights(tmp_path / case)


def test_model_safetensors_is_read_before_an_index_or_a_pytorch_model_bin_beside_it(tmp_path):
    """transformers' from_pretrained order (modeling_utils: model.safetensors, its index, pytorch_model.bin): a stale
    index left beside model.safetensors was read instead of it."""
    from core.checkpointing.hf_folders import read_hf_weights

    sharded(tmp_path, {"model-00001-of-00001.safetensors": {"w": 1}}, {"w": "model-00001-of-00001.safetensors"})
    torch.save({"w": torch.full((2,), 2.0)}, tmp_path / "pytorch_model.bin")
    save_file({"w": torch.full((2,), 3.0)}, str(tmp_path / "model.safetensors"))
    for value, then_remove in ((3, "model.safetensors"), (1, "model.safetensors.index.json"), (2, None)):
        assert read_hf_weights(tmp_path)["w"][0].item() == value
        if then_remove:
            (tmp_path / then_remove).unlink()


def test_weights_holding_nan_or_infinity_are_refused_by_name(tmp_path):
    from core.checkpointing.hf_folders import read_hf_weights

    good = {"a.weight": torch.ones(3), "b.weight": torch.zeros(2, dtype=torch.bfloat16), "ids": torch.arange(3)}
    for bad in (float("nan"), float("inf"), float("-inf")):
        save_file(good | {"b.weight": torch.tensor([1.0, bad]).bfloat16()}, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=r"'b.weight' hold NaN or infinite values; nothing was imported"):
            read_hf_weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(
        good | {"c": torch.tensor([float("nan")]), "d": torch.tensor([float("inf")])}, tmp_path / "pytorch_model.bin"
    )
    with pytest.raises(ValueError, match=r"'c' and 1 more hold NaN or infinite values"):
        read_hf_weights(tmp_path)
    torch.save(good, tmp_path / "pytorch_model.bin")
    assert sorted(read_hf_weights(tmp_path)) == ["a.weight", "b.weight", "ids"]
