"""The throughput meter: per-sample figures, or the recipe's counted work (real tokens and FLOPs)."""

from __future__ import annotations

import torch

from core.metrics import meter as meter_module
from core.metrics.meter import ThroughputMeter


def test_counted_work_replaces_the_per_sample_figures(monkeypatch):
    clock = iter([100.0, 104.0, 200.0, 202.0, 300.0])  # two intervals: 4 s, then 2 s
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: next(clock))
    meter = ThroughputMeter(
        torch.device("cpu"), global_batch_size=8, world_size=2, tokens_per_sample=1000, flops_per_sample=1e9
    )
    meter.peak_flops = 1e12
    meter.add_work([None, None])  # recipes without counted work: the per-sample figures
    meter.step_done()
    first = meter.record()
    assert first["samples_per_sec_per_gpu"] == 1.0 and first["tokens_per_sec_per_gpu"] == 1000.0
    assert first["mfu"] == 1e9 / 1e12
    for tokens in (300, 500):  # packed rows: 800 real tokens in 2 s on this rank
        meter.add_work([(torch.tensor(tokens), torch.tensor(tokens * 2e6))])
    meter.step_done()
    second = meter.record()
    assert second["tokens_per_sec_per_gpu"] == 400.0 and second["mfu"] == 800 * 2e6 / 2 / 1e12
    assert second["samples_per_sec_per_gpu"] == 2.0  # rows still count as samples


def test_a_recipe_without_accounting_reports_no_tokens_and_no_mfu(monkeypatch):
    """tokens_per_sample and flops_per_sample are optional for a recipe (None): the record then has neither
    tokens/s nor MFU, where it used to fail multiplying None."""
    clock = iter([100.0, 104.0, 200.0])
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: next(clock))
    meter = ThroughputMeter(
        torch.device("cpu"), global_batch_size=8, world_size=2, tokens_per_sample=None, flops_per_sample=None
    )
    meter.peak_flops = 1e12
    meter.add_work([None])
    meter.step_done()
    record = meter.record()
    assert record["samples_per_sec_per_gpu"] == 1.0
    assert "tokens_per_sec_per_gpu" not in record and "mfu" not in record


def test_counted_work_is_shared_by_the_ranks_that_split_each_sample(monkeypatch):
    """With tensor or context parallelism (ranks_per_sample = tp x cp) every such rank is handed the same samples'
    whole work by the recipe, and does its part: per GPU, the work divided among them, as the per-sample figures
    divide by the world size."""
    clock = iter([100.0, 102.0, 200.0])
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: next(clock))
    meter = ThroughputMeter(
        torch.device("cpu"), 8, world_size=4, tokens_per_sample=1000, flops_per_sample=1e9, ranks_per_sample=4
    )
    meter.peak_flops = 1e12
    meter.add_work([(torch.tensor(8000), torch.tensor(8e9))])  # the 8 samples' whole work, on each of the 4 ranks
    meter.step_done()
    record = meter.record()
    assert record["tokens_per_sec_per_gpu"] == 1000.0 == record["samples_per_sec_per_gpu"] * 1000
    assert record["mfu"] == 1e9 / 1e12
