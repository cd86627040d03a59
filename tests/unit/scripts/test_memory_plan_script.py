"""scripts/memory_plan.py: a config's memory plan for N GPUs of a given size, on a machine without them."""

from __future__ import annotations

import importlib.util

import pytest

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


def test_a_config_it_cannot_use_is_one_line_naming_the_key(capsys):
    script = _script()
    for overrides, said in (
        (["optim.lrr=1"], "config error: unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
        (["training.steps=abc"], "config error: training.steps=abc: Value 'abc'"),
        (["training.micro_batch_size=0"], "config error: training.micro_batch_size=0: expected an integer 1 <="),
        (["data=moby_dick"], "config error: data=moby_dick is data of the gpt recipe"),
        (["distributed.tp=2"], "config error: distributed.dp_shard=-1: world size 1 is not divisible"),
    ):
        assert script.main(["--config-name", "vit_sanity", *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith(said) and len(err.strip().splitlines()) == 1, err


def test_a_gpu_count_or_size_it_cannot_plan_for_is_refused_naming_the_option(capsys):
    script = _script()
    for args, said in (
        (["--gpus", "0"], "argument --gpus: expected a whole number of GPUs (1 or more), got 0"),
        (["--gpus", "-3"], "argument --gpus: expected a whole number of GPUs (1 or more), got -3"),
        (["--gpu-memory-gib", "nan"], "argument --gpu-memory-gib: expected a size in GiB above 0 (e.g. 80), got nan"),
        (["--gpu-memory-gib", "inf"], "argument --gpu-memory-gib: expected a size in GiB above 0 (e.g. 80), got inf"),
        (["--gpu-memory-gib", "0"], "argument --gpu-memory-gib: expected a size in GiB above 0 (e.g. 80), got 0"),
    ):
        with pytest.raises(SystemExit) as exit_:
            script.main(["--config-name", "vit_sanity", *args])
        assert exit_.value.code == 2 and said in capsys.readouterr().err, args
