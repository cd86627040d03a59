"""The throughput meter: per-sample figures, or the recipe's counted work (real tokens and FLOPs)."""

from __future__ import annotations

import torch

from core.metrics import meter as meter_module
from core.metrics.meter import ThroughputMeter


def test_counted_work_replaces_the_per_sample_figures(monkeypatch):
    clock = iter([100.0, 104.0, 200.0, 202.0, 300.0])  # two intervals: 4 s, then 2 s
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: next(clock))
    meter = ThroughputMeter(torch.device("cpu"), global_batch_size=8, world_size=2, tokens_per_sample=1000,
                            flops_per_sample=1e9)
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
