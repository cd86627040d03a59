"""What a resume checks in what its checkpoint holds (the step folder's config.yaml against the run's schemas
and settings: core/checkpointing/changes.py), the stream position it continues from (core/data/pipeline.py),
and files of another shape met by checkpoint.py, the GPT's tokenizer and generate.py: an error line naming the
file or key, not a traceback."""

from __future__ import annotations

import json
import re
import shlex
from types import SimpleNamespace

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from PIL import Image
from torch.utils.data import Dataset

import train
from checkpoint import main as checkpoint_cli
from core.checkpointing.changes import config_changes
from core.checkpointing.layout import CheckpointError
from core.checkpointing.weights import load_weights_file
from core.config.errors import ConfigError
from core.config.validation import save_config
from core.data.datasets import MultiEpochDatasetResampler, epoch_index
from core.data.fingerprint import data_fingerprint
from core.data.pipeline import TrainingData
from core.layers.context_parallel import ContextParallel
from core.training.state import TrainState
from recipes.base import Datasets
from recipes.mnist.data import MNISTSamples
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets
from tests.support.helpers import compose_config, validated_config

VIT = [
    "data=synthetic",
    "model.hidden_size=32",
    "model.depth=2",
    "model.num_heads=2",
    "training.steps=4",
    "training.global_batch_size=16",
    "training.micro_batch_size=4",
]


@pytest.fixture(scope="module")
def vit_cfg(tmp_path_factory):
    def config(*overrides):
        return validated_config("vit_sanity", [*VIT, *overrides, f"checkpoint.path={tmp_path_factory.mktemp('ckpt')}"])

    return config


def _saved(tmp_path, cfg, edit) -> object:
    """config.yaml as the run of `cfg` writes it, then `edit(tree)` applied."""
    file = tmp_path / "config.yaml"
    save_config(cfg, file)
    tree = yaml.safe_load(file.read_text())
    edit(tree)
    file.write_text(yaml.safe_dump(tree))
    return file


def test_a_result_key_the_saved_config_lacks_is_compared_with_its_default(vit_cfg, tmp_path):
    # The schema's default for optim.lr is 0.001 (vit_sanity sets 0.002): the version that wrote a file
    # without the key ran with 0.001.
    file = _saved(tmp_path, vit_cfg("optim.lr=0.001"), lambda t: t["optim"].pop("lr"))
    refused, other = config_changes(file, vit_cfg("optim.lr=0.001"))
    assert refused == [] and "optim.lr: (absent: the default) -> 0.001" in other
    refused, _ = config_changes(file, vit_cfg("optim.lr=0.05"))
    assert refused == ["optim.lr: 0.001 (absent from the file: the default) -> 0.05"]
    # Control: the key present and changed is refused as before.
    present = _saved(tmp_path, vit_cfg("optim.lr=0.001"), lambda t: None)
    assert config_changes(present, vit_cfg("optim.lr=0.05"))[0] == ["optim.lr: 0.001 -> 0.05"]
    # A key without a default cannot show the run is the same one.
    file = _saved(tmp_path, vit_cfg(), lambda t: t["training"].pop("global_batch_size"))
    refused, _ = config_changes(file, vit_cfg())
    assert len(refused) == 1 and refused[0].startswith(
        f"training.global_batch_size: absent from {file}, and its schema has no default"
    )


def test_keys_that_leave_the_result_alone_may_differ_or_be_absent(vit_cfg, tmp_path):
    def edit(tree):
        tree["training"].pop("log_every_n_steps")
        tree["training"]["steps"] = 2

    refused, other = config_changes(_saved(tmp_path, vit_cfg(), edit), vit_cfg())
    assert refused == []
    assert "training.log_every_n_steps: '(absent)' -> 20" in other and "training.steps: 2 -> 4" in other


@pytest.mark.parametrize(
    "edit,where",
    [
        (lambda t: t.update(model=[1, 2]), "'model' is a list, expected a mapping of settings"),
        (lambda t: t.update(model=None), "'model' is a NoneType, expected a mapping of settings"),
        (lambda t: t["model"].update(nope=1), "model.nope: Key 'nope' not in 'ViTModelConfig'"),
        (lambda t: t["model"].update(depth="two"), "model.depth: Value 'two' of type 'str' could not be converted"),
        (lambda t: t["optim"].update(lr=[1]), "optim.lr: Value '[1]' of type 'ListConfig' could not be converted"),
        (lambda t: t.update(model_was={}), "model_was: Key 'model_was' not in 'TrainConfig'"),
    ],
    ids=["section-list", "section-null", "unknown-key", "wrong-type", "wrong-type-core", "unknown-top-key"],
)
def test_a_saved_config_that_does_not_fit_the_schemas_is_refused(vit_cfg, tmp_path, edit, where):
    file = _saved(tmp_path, vit_cfg(), edit)
    refused, other = config_changes(file, vit_cfg())
    assert other == [] and len(refused) == 1
    assert refused[0].startswith(f"{file}: {where}") and refused[0].endswith("cannot be compared")


def test_another_recipes_config_is_one_refused_line(vit_cfg, tmp_path):
    file = _saved(tmp_path, vit_cfg(), lambda t: t.update(recipe="mnist"))
    assert config_changes(file, vit_cfg()) == (["recipe: 'mnist' -> 'vit'"], [])


# --- the stream position -------------------------------------------------------------------------------------


class _Positions(Dataset):
    """48 samples that say which (epoch, index) they were asked for."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index) -> dict:
        e = epoch_index(index)
        return {"epoch": e.epoch, "idx": e.idx}


class _Recipe:
    def build_datasets(self) -> Datasets:
        return Datasets(_Positions(), None)

    def collate_fn(self):
        return None

    def to_device(self, batch: dict, device) -> dict:
        return batch

    def prefetch_threads(self) -> int:
        return 1


def test_the_training_stream_continues_from_any_position():
    """A run resumed with another global batch (checkpoint.allow_config_changes) stands at any count: 72 is no
    multiple of 16, and 1000 lies past training.steps x global batch = 96 (it was an IndexError at the first
    step). The samples are the stream's at those positions, as from 0."""
    cfg = OmegaConf.create(
        {
            "seed": 3,
            "data": {"num_workers": 0, "pin_memory": False},
            "training": {
                "steps": 6,
                "epochs": None,
                "micro_batch_size": 4,
                "global_batch_size": 16,
                "limit_val_batches": 0,
            },
        }
    )
    env = SimpleNamespace(device=torch.device("cpu"), dp_size=1, dp_rank=0, context_parallel=ContextParallel)
    data = TrainingData(_Recipe(), cfg, env, accumulation=4)
    stream = MultiEpochDatasetResampler(_Positions(), num_samples=10**6, seed=3)
    for consumed in (1000, 72, 0):
        batches = list(data.micro_batches(consumed, 8))  # 2 steps
        got = [(int(e), int(i)) for b in batches for e, i in zip(b["epoch"], b["idx"])]
        assert got == [tuple(stream.epoch_index(p)) for p in range(consumed, consumed + 32)], consumed


def _digit_folder(root, classes=("0", "1", "2"), per_class=3) -> None:
    for c in classes:
        (root / "train" / c).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (28, 28), (40 * i, 0, 0)).save(root / "train" / c / f"{i}.png")


def _image_train_set(root) -> Dataset:
    data = ImageDataConfig(format="imagefolder", root=str(root), num_classes=3, num_workers=0)
    return build_image_datasets(data, ViTModelConfig(img_size=28, patch_size=4, num_classes=3), seed=0)[0]


@pytest.mark.parametrize(
    "change,says",
    [
        # classes sort by name: with "1" renamed "9", class 2's images train as label 1
        (lambda r: (r / "train/1").rename(r / "train/9"), r"the same number \(9\), but other files"),
        (lambda r: (r / "train/0/2.png").rename(r / "train/0/7.png"), r"the same number \(9\), but other files"),
        (lambda r: (r / "train/2/2.png").unlink(), r"training samples: 9 -> 8"),
    ],
    ids=["class-renamed", "file-renamed", "file-removed"],
)
def test_a_resume_on_a_changed_training_set_is_refused(tmp_path, caplog, change, says):
    """Between the stop and the resume the data folder changed under the same data.root: the resume stops before
    any work naming the checkpoint and the change (it continued silently on relabelled classes or, for another
    length, with a warning), and continues with checkpoint.allow_config_changes=true."""
    _digit_folder(tmp_path / "d")
    before = _image_train_set(tmp_path / "d")
    saved = TrainState(step=2, consumed_samples=8, dataset_len=len(before), data_fingerprint=data_fingerprint(before))
    assert saved.data_fingerprint > 0
    train.check_same_data(tmp_path / "step_2", saved, data_fingerprint(before), len(before), False, True)  # same data
    change(tmp_path / "d")
    after = _image_train_set(tmp_path / "d")
    with pytest.raises(ConfigError, match=f"resuming from {tmp_path / 'step_2'}, but the training data .*{says}"):
        train.check_same_data(tmp_path / "step_2", saved, data_fingerprint(after), len(after), False, True)
    train.check_same_data(tmp_path / "step_2", saved, data_fingerprint(after), len(after), True, True)
    assert "on changed training data" in caplog.text


def test_mnist_samples_fingerprint_their_labels_and_pixels():
    images, labels = torch.zeros(6, 28, 28, dtype=torch.uint8), torch.arange(6) % 3
    rows = torch.arange(4)
    same = data_fingerprint(MNISTSamples(images.clone(), labels.clone(), rows))
    assert same == data_fingerprint(MNISTSamples(images, labels, rows)) > 0
    assert data_fingerprint(MNISTSamples(images, labels.roll(1), rows)) != same
    assert data_fingerprint(MNISTSamples(images, labels, torch.arange(1, 5))) != same
    assert data_fingerprint(_Positions()) == 0  # no fingerprint: compared by length only


def test_without_fingerprints_a_changed_length_is_a_warning(tmp_path, caplog):
    """GPT's training set has no fingerprint, and its length follows training.steps once they pass an epoch: an
    extension stays allowed. So does a checkpoint of an earlier version, which recorded none."""
    for saved_fingerprint, now_fingerprint in ((0, 0), (0, 5), (5, 0)):
        saved = TrainState(step=2, dataset_len=9001, data_fingerprint=saved_fingerprint)
        train.check_same_data(tmp_path / "step_2", saved, now_fingerprint, 18002, False, True)
        train.check_same_data(tmp_path / "step_2", saved, now_fingerprint, 9001, False, True)
    assert caplog.text.count("training samples: 9001 -> 18002") == 3


# --- weight files and the checkpoint command ---------------------------------------------------------------


@pytest.mark.parametrize(
    "state,says",
    [
        ({1: torch.zeros(2)}, "a key that is not a name (1, type int)"),
        ({"model": {"w": torch.zeros(1), (2,): torch.zeros(1)}}, "a key that is not a name ((2,), type tuple)"),
        ({"w": 3}, "'w' holds a value of type int, not a tensor"),
        ([torch.zeros(1)], "a list, expected a dict of tensors"),
    ],
    ids=["int-key", "nested-tuple-key", "not-a-tensor", "list"],
)
def test_a_weights_file_that_is_not_a_state_dict_is_refused(tmp_path, state, says):
    file = tmp_path / "weights.pt"
    torch.save(state, file)
    with pytest.raises(CheckpointError, match=re.escape(f"{file}: {says}")):
        load_weights_file(file)
    with pytest.raises(SystemExit, match=re.escape(f"error: {file}: {says}")):  # was an AttributeError traceback
        checkpoint_cli(["from-torch", str(file), str(tmp_path / "step_0")])


@pytest.mark.parametrize("command", ["to-torch", "to-safetensors"])
def test_an_output_that_cannot_be_written_is_an_error_line(tmp_path, command):
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    with pytest.raises(SystemExit, match="a folder of weights alone holds step 0; name it step_0"):
        checkpoint_cli(["from-torch", str(tmp_path / "w.pt"), str(tmp_path / "step_1")])
    assert not (tmp_path / "step_1").exists()
    checkpoint_cli(["from-torch", str(tmp_path / "w.pt"), str(tmp_path / "step_0")])  # a step folder to convert
    for out, says in ((tmp_path / "missing" / "out.bin", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(SystemExit, match=re.escape("error: [Errno") + ".*" + re.escape(f"{says}: '{out}'")):
            checkpoint_cli([command, str(tmp_path / "step_0"), str(out)])
    checkpoint_cli([command, str(tmp_path / "step_0"), str(tmp_path / "out.bin")])  # control: a writable path
    assert (tmp_path / "out.bin").stat().st_size > 0


def test_the_checkpoint_command_exits_3_for_a_checkpoint_and_2_for_other_inputs(tmp_path):
    """`python checkpoint.py ...` ends with its one line and an exit code a script can tell apart: 3 for a
    checkpoint to fix, 2 for another input or output (it was 1 for everything)."""
    from tests.support.helpers import REPO, run_python

    (tmp_path / "step_5").mkdir()  # a save that never completed
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    checkpoint_cli(["from-torch", str(tmp_path / "w.pt"), str(tmp_path / "step_0")])
    for args, code, says in (
        (["to-torch", tmp_path / "step_5", tmp_path / "o.pt"], 3, "incomplete checkpoint"),
        (["to-torch", tmp_path / "step_0", tmp_path / "no" / "o.pt"], 2, "No such file"),
    ):
        proc = run_python(REPO / "checkpoint.py", *args, cwd=tmp_path)
        assert proc.returncode == code and proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# --- the GPT's tokenizer folder, Hugging Face import, vocabulary and generate.py ---------------------------------

LLAMA = {
    "vocab_size": 258,
    "hidden_size": 16,
    "ffn_hidden_size": 24,
    "num_layers": 1,
    "num_attention_heads": 2,
    "num_query_groups": 1,
    "seq_length": 32,
    "norm_epsilon": 1e-5,
    "tie_embeddings": False,
    "rotary_base": 10000.0,
    "init_std": 0.02,
}


def _hf_folder(folder, **config):
    """A tiny Llama folder (zero weights) with the byte tokenizer; `config` overrides config.json's fields."""
    from safetensors.torch import save_file

    from recipes.gpt.hf import llama_config, llama_shapes, write_byte_tokenizer

    folder.mkdir(parents=True)
    save_file({k: torch.zeros(shape) for k, shape in llama_shapes(LLAMA).items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(llama_config(LLAMA, 258, {}, "float32") | config))
    write_byte_tokenizer(folder, 256, 257)
    return folder


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_tokenizer_settings_file_that_is_not_an_object_is_refused(tmp_path, name):
    from recipes.gpt.hf import declared_special_ids
    from recipes.gpt.tokenizer import HFTokenizer

    folder = _hf_folder(tmp_path / "hf")
    (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))  # no eos: the map is read too
    (folder / name).write_text("[1]")
    says = re.escape(f"{folder / name}: a JSON list, expected an object")
    with pytest.raises(ConfigError, match=says):  # training, generate.py, to-hf (was an AttributeError)
        HFTokenizer(str(folder))
    with pytest.raises(ConfigError, match=says):  # to-hf's bos and pad ids
        declared_special_ids(folder / "tokenizer.json")


def test_from_hf_refuses_what_training_would_and_prints_a_command_that_reads_back(tmp_path, capsys):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from recipes.gpt.hf import import_from_hf

    with pytest.raises(
        ValueError,
        match=r"config\.json: rms_norm_eps=1e-320, but the GPT recipe's model needs "
        r"1e-30 <= norm_epsilon <= 1 \(it becomes model\.norm_epsilon\)",
    ):
        import_from_hf(str(_hf_folder(tmp_path / "tiny_eps", rms_norm_eps=1e-320)), str(tmp_path / "a.safetensors"))
    assert not (tmp_path / "a.safetensors").exists()
    folder = _hf_folder(tmp_path / "my models, v2" / "llama [tiny]")  # a space, a comma (a Hydra sweep), brackets
    out = tmp_path / "out dir" / "w.safetensors"
    import_from_hf(str(folder), str(out))
    command = shlex.split(capsys.readouterr().out.split("train, predict or generate with: ")[1])
    values = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(command)}
    assert values["data.tokenizer"] == str(folder) and values["checkpoint.init_from"] == str(out)
    assert values["model.norm_epsilon"] == 1e-5


def test_a_vocab_size_below_the_tokenizers_is_a_config_error(tmp_path):
    from recipes.gpt.recipe import GPTRecipe

    cfg = validated_config("gpt_sanity", ["model.vocab_size=5", f"checkpoint.path={tmp_path}/ckpt"])
    with pytest.raises(
        ConfigError,
        match=r"model\.vocab_size=5 is smaller than the vocabulary of "
        r"data\.tokenizer=byte \(258 tokens\)",
    ):
        GPTRecipe(cfg).vocab_size
    assert (
        GPTRecipe(validated_config("gpt_sanity", ["model.vocab_size=300", f"checkpoint.path={tmp_path}/c"])).vocab_size
        == 300
    )


def test_generate_shows_the_error_building_the_tokenizer(tmp_path, monkeypatch):
    """An AttributeError raised while building the tokenizer (a bug, a file of another shape) is that error, not
    "the gpt recipe is not one" (hasattr(recipe, "tokenizer") swallowed it)."""
    import generate
    import recipes.gpt.recipe

    def broken(*args, **kwargs):
        raise AttributeError("'list' object has no attribute 'get'")

    monkeypatch.setattr(recipes.gpt.recipe, "build_tokenizer", broken)
    (tmp_path / "w.safetensors").write_bytes(b"")  # not read: the tokenizer is needed first
    cfg = compose_config(
        "gpt_sanity",
        [
            f"checkpoint.init_from={tmp_path}/w.safetensors",
            "generate.prompt=hi",
            f"checkpoint.path={tmp_path}/unused",
            "logger.progress_bar=never",
        ],
    )
    with pytest.raises(AttributeError, match="'list' object has no attribute 'get'"):
        generate.generate(cfg, tmp_path / "run")
