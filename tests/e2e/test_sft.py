"""Supervised fine-tuning on chat rows (data.format=chat, configs/gpt_sft_sanity.yaml): the tiny Llama the repository
ships (data/tiny_llama) on the shipped chat set (data/chat_sanity), packed with document masks, on 2 CPU ranks. The
response-only validation loss falls clearly; a SIGTERM stop and resume gives the uninterrupted run's losses and
weights bit for bit, with full fine-tuning and with LoRA."""

from __future__ import annotations

import pytest
import torch

from tests.support.checkpoint_harness import run_phases
from tests.support.helpers import read_records, run_workers

TINY = [
    "model.backend=torch",
    "model.seq_length=128",  # rows of 128 tokens: about 3 conversations each
    "data.max_documents_per_sample=8",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",  # 2 ranks x 2 rows x 2 accumulation steps
    "training.log_every_n_steps=1",
    "training.val_every_n_steps=0",
    "scheduler.warmup_steps=2",
    "logger.progress_bar=never",
    "distributed=ddp",
]


def _phase(tmp, name, ckpt, extra=(), **kw) -> dict:
    return {
        "config": "gpt_sft_sanity",
        "overrides": TINY + list(extra) + [f"checkpoint.path={tmp}/{ckpt}"],
        "run_dir": f"{tmp}/{name}",
        **kw,
    }


def _val_loss(run_dir) -> float:
    return [r for r in read_records(run_dir) if r.get("split") == "val"][-1]["loss"]


@pytest.mark.slow
def test_sft_lowers_the_response_only_validation_loss_clearly(tmp_path):
    """The whole validation set's response-only loss of data/tiny_llama's weights, then after 40 steps."""
    val = ["training.val_at_end=true", "training.limit_val_batches=-1"]
    run_workers(
        2,
        run_phases,
        [
            # a step of lr 1e-30 moves no weight: the validation of the initial weights
            _phase(tmp_path, "before", "c0", val + ["training.steps=1", "optim.lr=1e-30"]),
            _phase(tmp_path, "after", "c1", val + ["training.steps=40"]),
        ],
    )
    before, after = _val_loss(tmp_path / "before"), _val_loss(tmp_path / "after")
    print(f"response-only validation loss: {before:.3f} before, {after:.3f} after 40 steps of SFT")
    assert after < 0.7 * before, (before, after)


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.slow
def test_sft_stops_and_goes_bitwise(mode, tmp_path):
    extra = [
        f"finetune.mode={mode}",
        "finetune.lora.rank=4",
        "finetune.lora.dropout=0.1",
        "model.hidden_dropout=0.1",  # so the RNG state matters across the stop
        "training.steps=6",
        "training.val_at_end=false",
    ]
    ranks = run_workers(
        2,
        run_phases,
        [
            _phase(tmp_path, "ref", "ckpt_ref", extra, state=True),
            _phase(tmp_path, "stopped", "ckpt", extra, signal_at=3),
            _phase(tmp_path, "resumed", "ckpt", extra, state=True),
        ],
    )
    ref, stopped, resumed = ranks[0]
    assert stopped["stopped_by"] == "SIGTERM" and max(stopped["losses"]) == 4 and resumed["start_step"] == 4
    assert stopped["losses"] | resumed["losses"] == ref["losses"] and sorted(ref["losses"]) == list(range(1, 7))
    assert stopped["samples"] + resumed["samples"] == ref["samples"]
    assert all(torch.equal(ref["state"][k], resumed["state"][k]) for k in ref["state"])
    lora = [k for k in ref["state"] if "lora_" in k]
    assert (len(lora) == 2 * 2 * 2) if mode == "lora" else not lora  # A and B on layernorm_qkv and proj, 2 layers
