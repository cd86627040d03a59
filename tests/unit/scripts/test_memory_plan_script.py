"""scripts/memory_plan.py: a config's memory plan for N GPUs of a given size, on a machine without them."""

from __future__ import annotations

import importlib.util

from tests.support.helpers import REPO

LLAMA_8B = ["model=llama3_8b", "model.vocab_size=32000", "training.micro_batch_size=1"]


def _script():
    spec = importlib.util.spec_from_file_location("memory_plan_script", REPO / "scripts" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_line_prints_the_plan_and_says_whether_it_fits(capsys):
    script = _script()
    assert script.main(["--config-name", "gpt_1b", "--gpus", "8", "--gpu-memory-gib", "80", *LLAMA_8B]) == 1
    out = capsys.readouterr().out
    assert out.startswith("memory plan per GPU: ~") and "of 80.0 GiB" in out and "optimizer state" in out
    assert "does not fit" in out and "set distributed.mfsdp.zero_dp_strategy=3: ~" in out
    assert script.main(["--config-name", "gpt_1b", "--gpu-memory-gib", "80"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("fits")
    assert script.main(["--config-name", "mnist_pretrain"]) == 0  # a model without transformer blocks: no plan
    assert "no memory plan" in capsys.readouterr().out
