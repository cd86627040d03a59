"""Task metrics equal scikit-learn's and scipy's, called directly with explicit arguments on fixed inputs; tiny cases
checked by hand; undefined figures are NaN with one warning naming why, never an exception."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import scipy.stats
import torch
from sklearn import metrics as skm

from core.metrics.task_metrics import (
    classification_metrics,
    multilabel_metrics,
    regression_metrics,
    residue_metrics,
    task_metric_names,
)

LOGGER = "core.metrics.task_metrics"


def _classes(n: int, c: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax probabilities that carry some signal about the targets (so no figure sits at chance)."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, c, n)
    logits = rng.normal(size=(n, c))
    logits[np.arange(n), targets] += 1.0
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return probs, targets


def test_regression_equals_scipy_and_sklearn_averaged_over_targets():
    rng = np.random.default_rng(0)
    true = rng.normal(size=(200, 3)) * [1.0, 5.0, 0.1] + [0.0, 3.0, -1.0]
    pred = true + rng.normal(size=(200, 3)) * [0.5, 4.0, 0.3]
    pred[:10, 0] = 0.25  # ties: Spearman's average ranks
    got = regression_metrics(torch.tensor(pred, dtype=torch.float64), torch.tensor(true))
    expected = {
        "spearman": np.mean([scipy.stats.spearmanr(pred[:, k], true[:, k]).statistic for k in range(3)]),
        "pearson": np.mean([scipy.stats.pearsonr(pred[:, k], true[:, k]).statistic for k in range(3)]),
        "rmse": np.mean([math.sqrt(skm.mean_squared_error(true[:, k], pred[:, k])) for k in range(3)]),
        "r2": np.mean([skm.r2_score(true[:, k], pred[:, k]) for k in range(3)]),
    }
    assert got.keys() == expected.keys() == set(task_metric_names("regression"))
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-12), name
    # the mean over targets, not the figure of the flattened values
    assert got["pearson"] != pytest.approx(scipy.stats.pearsonr(pred.ravel(), true.ravel()).statistic, rel=1e-3)


def test_regression_hand_checked():
    got = regression_metrics(np.array([1.0, 2.0, 3.0, 5.0]), np.array([1.0, 2.0, 3.0, 4.0]))
    assert got["spearman"] == 1.0  # the same order
    assert got["rmse"] == 0.5  # sqrt(1 / 4)
    assert got["r2"] == pytest.approx(1 - 1 / 5)  # residual 1, variance sum 5
    assert got["pearson"] == pytest.approx(np.corrcoef([1, 2, 3, 5], [1, 2, 3, 4])[0, 1])


def test_binary_classification_equals_sklearn_on_the_positive_class():
    probs, targets = _classes(300, 2, seed=1)
    got = classification_metrics(torch.tensor(probs, dtype=torch.float32), torch.tensor(targets))
    pred = probs.argmax(axis=1)
    assert got.keys() == set(task_metric_names("classification", num_classes=2))
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(targets, pred))
    assert got["macro_f1"] == pytest.approx(skm.f1_score(targets, pred, average="macro"))
    assert got["mcc"] == pytest.approx(skm.matthews_corrcoef(targets, pred))
    positive = probs[:, 1].astype(np.float32)  # the tensor given was float32
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(targets, positive, labels=[0, 1]), rel=1e-12)
    assert got["auprc"] == pytest.approx(skm.average_precision_score(targets, positive, pos_label=1), rel=1e-12)
    # class 1 is the positive class: the figure of class 0's probability is another number
    assert got["auprc"] != pytest.approx(skm.average_precision_score(targets == 0, probs[:, 0]), rel=1e-3)


def test_multiclass_classification_equals_sklearn_macro_one_vs_rest():
    probs, targets = _classes(400, 4, seed=2)
    got = classification_metrics(probs, targets)
    pred = probs.argmax(axis=1)
    assert got.keys() == set(task_metric_names("classification", num_classes=4))  # no auprc
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(targets, pred))
    assert got["macro_f1"] == pytest.approx(skm.f1_score(targets, pred, average="macro", labels=[0, 1, 2, 3]))
    assert got["mcc"] == pytest.approx(skm.matthews_corrcoef(targets, pred))
    expected = skm.roc_auc_score(targets, probs, multi_class="ovr", average="macro", labels=[0, 1, 2, 3])
    assert got["auroc"] == pytest.approx(expected, rel=1e-12)


def test_hand_checked_classification():
    # A perfect ranking whose argmax is wrong for one item: AUROC 1, accuracy 3/4.
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.55, 0.45], [0.2, 0.8]])
    got = classification_metrics(probs, np.array([0, 0, 1, 1]))
    assert got["auroc"] == 1.0 and got["auprc"] == 1.0 and got["accuracy"] == 0.75
    # predictions 0, 0, 0, 1: TN 2, FP 0, FN 1, TP 1 -> MCC = (1 * 2 - 0 * 1) / sqrt(1 * 2 * 2 * 3) = 1 / sqrt(3)
    assert got["mcc"] == pytest.approx(1 / math.sqrt(3))
    # F1 = 2TP / (2TP + FP + FN): class 0: 4 / (4 + 1 + 0); class 1: 2 / (2 + 0 + 1)
    assert got["macro_f1"] == pytest.approx((4 / 5 + 2 / 3) / 2)


def test_macro_f1_averages_the_classes_in_targets_or_predictions():
    """Class 2 occurs in neither: it has no F1 and is not averaged (with labels=[0, 1, 2] sklearn would add a 0)."""
    probs = np.array([[0.8, 0.1, 0.1], [0.7, 0.2, 0.1], [0.2, 0.7, 0.1], [0.6, 0.3, 0.1]])
    targets = np.array([0, 0, 1, 1])  # predictions 0, 0, 1, 0
    f1_0, f1_1 = 2 * 2 / (2 * 2 + 1 + 0), 2 * 1 / (2 * 1 + 0 + 1)
    for got in (classification_metrics(probs, targets)["macro_f1"], residue_metrics(probs, targets)["macro_f1"]):
        assert got == pytest.approx((f1_0 + f1_1) / 2)
        assert got != pytest.approx(
            skm.f1_score(targets, probs.argmax(1), labels=[0, 1, 2], average="macro", zero_division=0)
        )
    # A class only predicted counts 0: predictions 0, 2 for targets 0, 0 -> (2/3 + 0) / 2
    only_predicted = residue_metrics(np.array([[0.9, 0.0, 0.1], [0.1, 0.0, 0.9]]), np.array([0, 0]))
    assert only_predicted["macro_f1"] == pytest.approx((2 / 3 + 0) / 2)


def test_residue_metrics_equal_sklearn_on_many_residues():
    probs, targets = _classes(20_000, 8, seed=3)
    got = residue_metrics(torch.tensor(probs).to(torch.bfloat16), torch.tensor(targets))
    pred = torch.tensor(probs).to(torch.bfloat16).float().argmax(1).numpy()  # what the given bf16 values rank first
    assert got.keys() == set(task_metric_names("residue_classification"))
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(targets, pred))
    assert got["macro_f1"] == pytest.approx(skm.f1_score(targets, pred, average="macro"))


def test_multilabel_equals_sklearn_macro():
    rng = np.random.default_rng(4)
    targets = (rng.random((300, 5)) < [0.1, 0.3, 0.5, 0.7, 0.2]).astype(np.float32)
    probs = 1 / (1 + np.exp(-(rng.normal(size=(300, 5)) + 1.5 * (targets - 0.5))))
    got = multilabel_metrics(torch.tensor(probs), torch.tensor(targets))
    pred = (probs >= 0.5).astype(int)
    assert got.keys() == set(task_metric_names("multilabel"))
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(targets.astype(int), pred))  # subset accuracy
    assert got["macro_f1"] == pytest.approx(skm.f1_score(targets.astype(int), pred, average="macro"))
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(targets, probs, average="macro"), rel=1e-12)
    assert got["auprc"] == pytest.approx(skm.average_precision_score(targets, probs, average="macro"), rel=1e-12)


def test_multilabel_leaves_out_labels_without_both_values(caplog):
    probs = np.array([[0.9, 0.2, 0.1], [0.4, 0.6, 0.2], [0.8, 0.1, 0.3], [0.1, 0.7, 0.05]])
    targets = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 1, 0]])  # label 2: never positive
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = multilabel_metrics(probs, targets)
    # label 0 ranks perfectly (AUROC 1); label 1: positives 0.6, 0.1, 0.7 vs negative 0.2 -> 2 of 3 pairs right
    assert got["auroc"] == pytest.approx((1.0 + 2 / 3) / 2)
    assert got["auprc"] == pytest.approx(
        (
            skm.average_precision_score(targets[:, 0], probs[:, 0])
            + skm.average_precision_score(targets[:, 1], probs[:, 1])
        )
        / 2
    )
    assert got["accuracy"] == 0.75  # items 0, 1 and 3 have every label right; item 2 misses label 1
    assert [r.getMessage() for r in caplog.records] == [
        "multilabel metrics: auroc leaves out label 2 (present in every target or in none)"
    ]


@pytest.mark.parametrize(
    "call, nan_names, why",
    [
        (lambda: classification_metrics(np.array([[0.3, 0.7], [0.6, 0.4]]), np.array([1, 1])), {"auroc"}, "one class"),
        (
            lambda: classification_metrics(np.array([[0.3, 0.7], [0.6, 0.4]]), np.array([0, 0])),
            {"auroc", "auprc"},
            "class 1",
        ),
        (lambda: classification_metrics(_classes(9, 3, 0)[0], np.zeros(9, int)), {"auroc"}, "no class"),
        (lambda: regression_metrics(np.ones(5), np.arange(5.0)), {"spearman", "pearson"}, "constant predictions"),
        (lambda: regression_metrics(np.arange(5.0), np.ones(5)), {"spearman", "pearson", "r2"}, "constant targets"),
        (lambda: regression_metrics(np.ones(1), np.ones(1)), {"spearman", "pearson", "r2"}, "fewer than 2 items"),
        (lambda: residue_metrics(np.zeros((0, 3)), np.zeros(0, int)), {"accuracy", "macro_f1"}, "no items"),
        (
            lambda: multilabel_metrics(np.full((2, 2), np.nan), np.ones((2, 2))),
            set(task_metric_names("multilabel")),
            "not all finite",
        ),
        (
            lambda: regression_metrics(np.array([1.0, np.inf]), np.ones(2)),
            set(task_metric_names("regression")),
            "not all finite",
        ),
    ],
)
def test_undefined_figures_are_nan_with_one_warning(call, nan_names, why, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = call()
    assert {name for name, value in got.items() if math.isnan(value)} == nan_names
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()


def test_one_target_undefined_makes_the_mean_undefined():
    true = np.stack([np.arange(6.0), np.full(6, 2.0)], axis=1)  # target 1 constant
    got = regression_metrics(true + 0.1, true)
    assert math.isnan(got["r2"]) and math.isnan(got["pearson"]) and math.isnan(got["spearman"])
    assert got["rmse"] == pytest.approx(0.1)  # defined for every target


def test_mcc_of_a_constant_prediction_is_zero_as_in_sklearn():
    probs = np.array([[0.9, 0.1]] * 4)
    targets = np.array([0, 1, 0, 1])
    assert classification_metrics(probs, targets)["mcc"] == 0.0 == skm.matthews_corrcoef(targets, probs.argmax(1))


def test_task_names():
    assert task_metric_names("classification", 2)[-1] == "auprc"
    assert "auprc" not in task_metric_names("classification", 3)
    with pytest.raises(ValueError, match="num_classes"):
        task_metric_names("classification")
    with pytest.raises(ValueError, match="unknown task"):
        task_metric_names("segmentation")
