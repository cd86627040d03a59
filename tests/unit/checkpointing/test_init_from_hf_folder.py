"""checkpoint.init_from=<a Hugging Face folder> (core/checkpointing/weights.py): safetensors only (a pickled
pytorch_model.bin is refused by name, never loaded), through the recipe's converter, its errors as one line."""

import pytest
import torch
from safetensors.torch import save_file

from core.checkpointing.layout import CheckpointError
from core.checkpointing.weights import _read_hf_folder, is_hf_folder


def _folder(tmp_path, *files):
    (tmp_path / "config.json").write_text("{}")
    for name in files:
        (tmp_path / name).write_bytes(b"\x80\x04not read")
    return tmp_path


def test_a_pickled_weights_file_is_refused_by_name_and_never_read(tmp_path):
    folder = _folder(tmp_path, "pytorch_model.bin")
    assert is_hf_folder(folder)
    read = []
    with pytest.raises(CheckpointError, match="pytorch_model.bin is a pickle, which can run code"):
        _read_hf_folder(folder, str(folder), lambda f: read.append(f) or {})
    assert read == []


def test_a_recipe_without_a_converter_and_a_converter_error_are_one_line(tmp_path):
    folder = _folder(tmp_path)
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="this recipe has no Hugging Face conversion"):
        _read_hf_folder(folder, "X", None)

    def wrong(_):
        raise ValueError("the run's model settings differ from config.json's: model.hidden_size=64 (config.json: 32)")

    with pytest.raises(CheckpointError, match=r"checkpoint.init_from=X: the run's model settings differ .*hidden_size"):
        _read_hf_folder(folder, "X", wrong)
    assert _read_hf_folder(folder, "X", lambda f: {"a": torch.ones(1)}) == {"a": torch.ones(1)}


def test_a_step_folder_is_not_a_hugging_face_folder(tmp_path):
    _folder(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"")
    assert not is_hf_folder(tmp_path) and not is_hf_folder(tmp_path / "absent")
