"""Validation over every item: forward's "items" of valid rows, gathered over the data-parallel ranks (uneven counts,
padding rows dropped), summarised by the recipe; a recipe without items reports what the sums alone give, with no
further collective."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from core.data.sampling import EvalBatchSampler, PaddedEval
from core.metrics.task_metrics import classification_metrics, regression_metrics
from core.training import evaluation
from tests.support.helpers import run_workers

SAMPLES = 11  # over 2 ranks: 6 and 5 samples, rank 1's share padded with one invalid sample
MAX_ITEMS = 3


def _sample(i: int) -> dict:
    """Row i holds (i + 2) % 4 items (0 to 3; sample 0, which pads a short share, holds 2): values that carry some
    signal about their targets, so no figure is trivial."""
    g = torch.Generator().manual_seed(i)
    targets = torch.randn(MAX_ITEMS, generator=g, dtype=torch.float64)
    return {
        "x": targets + 0.7 * torch.randn(MAX_ITEMS, generator=g, dtype=torch.float64),
        "y": targets,
        "n": torch.tensor((i + 2) % 4),
    }


class ItemsRecipe:
    """Per row: a loss summed over its items; per item: a prediction, its target, class probabilities and a flag."""

    name = "items"

    def __init__(self, with_items: bool = True):
        self.with_items = with_items
        self.seen: dict[str, torch.Tensor] = {}

    def to_device(self, batch, device):
        return batch

    def forward(self, model, batch, training):
        n = batch["n"]
        mask = torch.arange(MAX_ITEMS) < n[:, None]
        error = (batch["x"] - batch["y"]) ** 2 * mask
        out = {"loss": error.sum(1), "count": n.to(torch.float64)}
        if self.with_items:
            row = torch.arange(len(n)).repeat_interleave(n)
            pred, true = batch["x"][mask], batch["y"][mask]
            probs = torch.stack([torch.sigmoid(-pred), torch.sigmoid(pred)], dim=1).to(torch.float32)
            out["items"] = {"row": row, "pred": pred, "true": true, "probs": probs, "positive": true > 0}
        return out

    def summarize_validation(self, means):
        return means

    def summarize_items(self, items):
        self.seen = items
        return {
            **regression_metrics(items["pred"], items["true"]),
            **classification_metrics(items["probs"], items["positive"].long()),
        }


def _validate(batch_size: int) -> dict[str, tuple[dict, dict]]:
    """On each rank of a gloo group: evaluate over this rank's share (EvalBatchSampler, as training's loader), for a
    recipe with items and for one without (which must not gather: dist.all_gather is removed for it)."""
    dist.init_process_group("gloo")
    try:
        sampler = EvalBatchSampler(SAMPLES, batch_size, dist.get_world_size(), dist.get_rank())
        dataset = PaddedEval([_sample(i) for i in range(SAMPLES)])
        results = {}
        for case in ("items", "no items"):
            if case == "no items":
                dist.all_gather = None
            recipe = ItemsRecipe(with_items=case == "items")
            loader = [default_collate([dataset[i] for i in indices]) for indices in sampler]  # evaluate pops "valid"
            cpu = torch.device("cpu")
            results[case] = evaluation.evaluate(recipe, torch.nn.Identity(), loader, contextlib.nullcontext, cpu, None)
            results[case] = (results[case], recipe.seen)
        return results
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_items_gathered_over_two_ranks_give_the_metrics_of_all_items_in_one_process():
    """Rank 0 holds 6 samples, rank 1 5 and a padding row (sample 0 again, with 2 items): 9 and 9 + 2 padding items.
    A recipe without items gets the sums alone, with no gather (the same on both ranks)."""
    first, second = run_workers(2, _validate, 2)
    expected_items = _items_of(range(SAMPLES))
    expected = regression_metrics(expected_items["pred"], expected_items["true"])
    expected |= classification_metrics(expected_items["probs"], expected_items["positive"].long())
    samples = [_sample(i) for i in range(SAMPLES)]
    loss = sum(float(((s["x"] - s["y"]) ** 2)[: s["n"]].sum()) for s in samples) / sum(int(s["n"]) for s in samples)
    # every rank has every item, padding rows' dropped: rank 0's items (samples 0, 2, ..., 10) then rank 1's
    by_rank = _items_of([i for rank in (0, 1) for i in range(rank, SAMPLES, 2)])
    for metrics, items in (first["items"], second["items"]):
        assert items.keys() == expected_items.keys()
        for key in items:
            assert items[key].dtype == expected_items[key].dtype
            assert torch.equal(items[key], by_rank[key]), key
        assert sorted(metrics) == sorted(["loss", *expected])
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, rel=1e-12), name
        assert metrics["loss"] == pytest.approx(loss, rel=1e-12)
    assert first["items"][0] == second["items"][0]
    assert first["no items"] == second["no items"] == ({"loss": pytest.approx(loss, rel=1e-12)}, {})


def _items_of(samples) -> dict[str, torch.Tensor]:
    """The items of these samples, as one process over one batch of them gives them."""
    out = ItemsRecipe().forward(None, default_collate([_sample(i) for i in samples]), training=False)
    return {k: v for k, v in out["items"].items() if k != "row"}


def test_padding_rows_items_are_dropped_and_row_is_not_kept():
    items = {"row": torch.tensor([0, 0, 1, 2, 2]), "v": torch.arange(5.0)}
    kept = evaluation.valid_items(items, torch.tensor([True, False, True]))
    assert kept.keys() == {"v"} and kept["v"].tolist() == [0.0, 1.0, 3.0, 4.0]
    with pytest.raises(RuntimeError, match="'v' has 4 entries for 5 rows"):
        evaluation.valid_items({**items, "v": torch.arange(4.0)}, torch.ones(3, dtype=torch.bool))


def test_a_name_in_both_summaries_is_refused(monkeypatch):
    class Clashing(ItemsRecipe):
        def summarize_items(self, items):
            return {"loss": 0.0}

    monkeypatch.setattr(evaluation.dist, "all_reduce", lambda tensor, group=None: None)  # one process, no group
    batch = default_collate([{**_sample(i), "valid": True} for i in range(4)])
    with pytest.raises(RuntimeError, match=r"reports \['loss'\] from both"):
        evaluation.evaluate(Clashing(), torch.nn.Identity(), [batch], contextlib.nullcontext, torch.device("cpu"), None)
