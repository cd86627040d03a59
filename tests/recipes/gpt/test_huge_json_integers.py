"""An integer longer than Python converts (sys.get_int_max_str_digits: json.loads raises a plain ValueError, not a
JSONDecodeError) in any JSON file a user hands in is a one-line DataError naming the file and line, not a traceback:
JSON Lines (chat rows, generate.py's prompts), GPT preprocess's .jsonl, a tokenizer folder's settings; in a PEFT
adapter's safetensors metadata it is read as another tool's (no settings of ours), as damaged metadata is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from core.config.errors import DataError
from core.data.json_lines import json_lines
from core.generation.prompts import read_prompts
from recipes.gpt.preprocess import read_documents
from recipes.gpt.tokenizer import read_settings_file

HUGE = "9" * (sys.get_int_max_str_digits() + 1)


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "hi", "text": "hi"}\n' + f'{{"prompt": "hi", "text": "hi", "n": {HUGE}}}\n')
    return path


def test_json_lines_and_prompt_files_name_the_line(jsonl):
    with pytest.raises(DataError, match=r"^src: line 2 is not JSON Python reads \(Exceeds the limit"):
        list(json_lines(jsonl, "src"))
    with pytest.raises(DataError, match=r"generate.prompt_file=.*rows.jsonl: line 2 is not JSON Python reads"):
        read_prompts(jsonl)


def test_preprocess_names_the_line(jsonl):
    with pytest.raises(DataError, match=r"rows.jsonl:2: not JSON \(ValueError: Exceeds the limit"):
        list(read_documents(jsonl))


def test_tokenizer_settings_name_the_file(tmp_path):
    file = tmp_path / "tokenizer_config.json"
    file.write_text(f'{{"eos_token": "</s>", "model_max_length": {HUGE}}}')
    with pytest.raises(DataError, match=r"tokenizer_config.json: unreadable as JSON \(ValueError: Exceeds the limit"):
        read_settings_file(file, "data.tokenizer=x")


def test_adapter_metadata_with_a_huge_integer_is_not_ours(tmp_path):
    from safetensors.torch import save_file

    from core.checkpointing.hf_folders import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter

    (tmp_path / ADAPTER_CONFIG).write_text('{"peft_type": "LORA"}')
    save_file({"w": torch.zeros(1)}, str(tmp_path / ADAPTER_WEIGHTS), metadata={"gpt": f'{{"n": {HUGE}}}'})
    assert read_adapter(tmp_path, "gpt")[2] == {}
