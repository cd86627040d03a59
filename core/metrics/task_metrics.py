"""Task metrics over every validation (or prediction) item: regression, classification, multi-label and residue
classification figures, computed by scikit-learn and scipy on the CPU.

Inputs are torch tensors (any device, any float dtype) or numpy arrays; every function returns plain floats.
A figure the data leaves undefined (targets of one class, constant predictions, too few items, non-finite outputs) is
NaN, and the call logs one warning that names each such figure and why; these functions never raise on data.
Nothing loops over items in Python (a million residues take a fraction of a second); loops run over targets,
classes or labels only.

The figures (each defined exactly as the function's docstring says):
    regression      spearman, pearson, rmse, r2       means over the K targets
    classification  accuracy, macro_f1, mcc, auroc    (+ auprc for two classes)
    multilabel      accuracy, macro_f1, auroc, auprc  (accuracy: every label of an item right)
    residue         accuracy, macro_f1                over labelled residues (Q3/Q8 for 3 or 8 states)
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import numpy as np
import scipy.stats
import torch
from sklearn import metrics as skm

log = logging.getLogger(__name__)

NAN = float("nan")
REGRESSION = ("spearman", "pearson", "rmse", "r2")
CLASSIFICATION = ("accuracy", "macro_f1", "mcc", "auroc")
MULTILABEL = ("accuracy", "macro_f1", "auroc", "auprc")
RESIDUE = ("accuracy", "macro_f1")


def task_metric_names(task: str, num_classes: Optional[int] = None) -> tuple[str, ...]:
    """The names the task's metric function returns, known before any work (a recipe's validation_metrics).
    task: regression | classification | multilabel | residue_classification; classification needs num_classes
    (two classes add auprc)."""
    if task == "classification":
        if num_classes is None:
            raise ValueError("task_metric_names('classification') needs num_classes (two classes add auprc)")
        return CLASSIFICATION + (("auprc",) if num_classes == 2 else ())
    names = {"regression": REGRESSION, "multilabel": MULTILABEL, "residue_classification": RESIDUE}
    if task not in names:
        raise ValueError(f"unknown task {task!r}: regression, classification, multilabel or residue_classification")
    return names[task]


def regression_metrics(predictions, targets) -> dict[str, float]:
    """Per target k of K (columns of [N, K]; [N] is one target), then the mean over targets:
    spearman: Spearman's rank correlation (scipy.stats.spearmanr: Pearson's r of the ranks, ties averaged);
    pearson: Pearson's r (scipy.stats.pearsonr); rmse: sqrt(mean((prediction - target)^2));
    r2: 1 - sum((target - prediction)^2) / sum((target - mean(target))^2) (sklearn r2_score).
    Undefined, hence NaN for that target and so for the mean: the correlations when predictions or targets are
    constant or N < 2; r2 when targets are constant; every figure when N == 0 or an output is not finite."""
    pred, true = _floats(predictions), _floats(targets)
    if pred.shape != true.shape:
        raise ValueError(f"predictions {pred.shape} and targets {true.shape} differ in shape")
    pred, true = pred.reshape(len(pred), -1), true.reshape(len(true), -1)
    undefined = _undefined_inputs(pred, true)
    if undefined:
        return _all_nan(REGRESSION, "regression", undefined)
    reasons: list[str] = []
    spearman, pearson = np.full(pred.shape[1], NAN), np.full(pred.shape[1], NAN)
    constant_true, constant_pred = np.ptp(true, axis=0) == 0, np.ptp(pred, axis=0) == 0
    for k in range(pred.shape[1]):
        why = _correlation_undefined(len(pred), constant_pred[k], constant_true[k])
        if why:
            reasons.append(f"spearman and pearson of target {k} are NaN ({why})")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # near-constant inputs: scipy warns, the figure is still defined
            spearman[k] = scipy.stats.spearmanr(pred[:, k], true[:, k]).statistic
            pearson[k] = scipy.stats.pearsonr(pred[:, k], true[:, k]).statistic
    rmse = np.atleast_1d(skm.root_mean_squared_error(true, pred, multioutput="raw_values"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r2 = np.atleast_1d(skm.r2_score(true, pred, multioutput="raw_values", force_finite=False))
    r2[constant_true] = NAN  # 0/0 or x/0: no variance to explain
    reasons += [f"r2 of target {k} is NaN (constant targets)" for k in np.flatnonzero(constant_true)]
    _warn("regression", reasons)
    return {
        "spearman": float(spearman.mean()),
        "pearson": float(pearson.mean()),
        "rmse": float(rmse.mean()),
        "r2": float(r2.mean()),
    }


def classification_metrics(probabilities, targets) -> dict[str, float]:
    """probabilities [N, C] (softmax; C >= 2), targets [N] class indices in 0..C-1; the predicted class is the argmax.
    accuracy: the fraction predicted right; macro_f1 and mcc: as residue_metrics / sklearn matthews_corrcoef (its
    multi-class form; 0 when predictions or targets hold one class, sklearn's convention: no better than chance);
    auroc: two classes: the ROC AUC of the probability of class 1 (the positive class) against target == 1; more:
    the mean over classes of each class's one-vs-rest ROC AUC of its probability, over the classes that both occur and
    are absent in targets (all of them: sklearn roc_auc_score(multi_class="ovr", average="macro")); classes
    occurring in no target or every target are left out with a warning; NaN when none is left (one class only);
    auprc (two classes only): average precision of class 1 (sklearn average_precision_score: sum over thresholds of
    (recall_n - recall_n-1) * precision_n, not interpolated); NaN when no target is class 1."""
    probs, true = _floats(probabilities), _classes(targets)
    _check_classes(probs, true)
    names = CLASSIFICATION + (("auprc",) if probs.shape[1] == 2 else ())
    undefined = _undefined_inputs(probs, true)
    if undefined:
        return _all_nan(names, "classification", undefined)
    reasons: list[str] = []
    figures = _label_figures(probs.argmax(axis=1), true)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one class in targets and predictions: sklearn warns, and gives 0 as said
        figures["mcc"] = float(skm.matthews_corrcoef(true, probs.argmax(axis=1)))
    if probs.shape[1] == 2:
        figures["auroc"] = _binary_auroc(true == 1, probs[:, 1], "auroc", reasons)
        positives = bool((true == 1).any())
        figures["auprc"] = float(skm.average_precision_score(true == 1, probs[:, 1])) if positives else NAN
        reasons += [] if positives else ["auprc is NaN (no target is class 1)"]
    else:
        onehot = true[:, None] == np.arange(probs.shape[1])
        figures["auroc"] = _macro_auroc(onehot, probs, "class", reasons)
    _warn("classification", reasons)
    return figures


def multilabel_metrics(probabilities, targets) -> dict[str, float]:
    """probabilities [N, C] (sigmoid, one per label), targets [N, C] of 0/1; a label is predicted where its
    probability >= 0.5. accuracy: the fraction of items with every label right (subset accuracy, sklearn
    accuracy_score); macro_f1: the mean of each label's F1 = 2TP / (2TP + FP + FN) over the labels positive in some
    target or prediction (a label with neither has no F1, as in classification's macro_f1); auroc: the mean of each
    label's ROC AUC over the labels both positive and negative in targets (others left out with a warning; NaN when
    none is left); auprc: the mean of each label's average precision over the labels positive in some target (NaN
    when none is)."""
    probs, true = _floats(probabilities), _floats(targets)
    if probs.shape != true.shape or probs.ndim != 2:
        raise ValueError(f"probabilities {probs.shape} and targets {true.shape} must both be [N, C]")
    undefined = _undefined_inputs(probs, true)
    if undefined:
        return _all_nan(MULTILABEL, "multilabel", undefined)
    true, pred = true > 0.5, probs >= 0.5
    reasons: list[str] = []
    present = np.flatnonzero(true.any(axis=0) | pred.any(axis=0))
    f1 = skm.f1_score(true, pred, labels=present, average="macro", zero_division=0) if len(present) else NAN
    auroc = _macro_auroc(true, probs, "label", reasons)
    positive = np.flatnonzero(true.any(axis=0))
    if len(positive):
        auprc = float(skm.average_precision_score(true[:, positive], probs[:, positive], average="macro"))
    else:
        auprc = NAN
        reasons.append("auprc is NaN (no label is positive in any target)")
    _warn("multilabel", reasons)
    return {"accuracy": float(skm.accuracy_score(true, pred)), "macro_f1": float(f1), "auroc": auroc, "auprc": auprc}


def residue_metrics(probabilities, targets) -> dict[str, float]:
    """probabilities [M, C] (or logits: only the argmax is used) of the M labelled residues, targets [M] in 0..C-1.
    accuracy: the fraction of residues predicted right (Q3 / Q8 for 3 / 8 states); macro_f1: the mean of each class's
    F1 = 2TP / (2TP + FP + FN) over the classes that occur in targets or predictions (sklearn f1_score's default
    labels, average="macro"): a class neither labelled nor predicted has no F1 and is not averaged, a class only
    predicted counts 0."""
    probs, true = _floats(probabilities), _classes(targets)
    _check_classes(probs, true)
    undefined = _undefined_inputs(probs, true)
    if undefined:
        return _all_nan(RESIDUE, "residue", undefined)
    return _label_figures(probs.argmax(axis=1), true)


def _label_figures(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    return {
        "accuracy": float(skm.accuracy_score(true, pred)),
        "macro_f1": float(skm.f1_score(true, pred, average="macro", zero_division=0)),
    }


def _binary_auroc(positive: np.ndarray, score: np.ndarray, name: str, reasons: list[str]) -> float:
    if positive.all() or not positive.any():
        reasons.append(f"{name} is NaN (targets hold one class only)")
        return NAN
    return float(skm.roc_auc_score(positive, score))


def _macro_auroc(onehot: np.ndarray, scores: np.ndarray, kind: str, reasons: list[str]) -> float:
    """The mean one-vs-rest ROC AUC over the columns of onehot [N, C] that hold both values."""
    positives = onehot.sum(axis=0)
    both = np.flatnonzero((positives > 0) & (positives < len(onehot)))
    left_out = np.setdiff1d(np.arange(onehot.shape[1]), both)
    if not len(both):
        reasons.append(f"auroc is NaN (no {kind} is both present and absent in targets)")
        return NAN
    if len(left_out):
        listed = ", ".join(map(str, left_out.tolist()))
        reasons.append(f"auroc leaves out {kind} {listed} (present in every target or in none)")
    return float(np.mean([skm.roc_auc_score(onehot[:, c], scores[:, c]) for c in both]))


def _correlation_undefined(n: int, constant_pred: bool, constant_true: bool) -> str:
    if n < 2:
        return "fewer than 2 items"
    if constant_pred:
        return "constant predictions"
    return "constant targets" if constant_true else ""


def _undefined_inputs(outputs: np.ndarray, targets: np.ndarray) -> str:
    if len(outputs) == 0:
        return "no items"
    if not np.isfinite(outputs).all():
        return "the model's outputs are not all finite"
    return "" if np.isfinite(targets).all() else "the targets are not all finite"


def _all_nan(names: tuple[str, ...], task: str, why: str) -> dict[str, float]:
    log.warning("%s metrics: %s are NaN (%s)", task, ", ".join(names), why)
    return dict.fromkeys(names, NAN)


def _warn(task: str, reasons: list[str]) -> None:
    """One warning per call, naming every figure the data left undefined or partial, and why."""
    if reasons:
        log.warning("%s metrics: %s", task, "; ".join(reasons))


def _check_classes(probs: np.ndarray, true: np.ndarray) -> None:
    if probs.ndim != 2 or probs.shape[1] < 2 or true.shape != (len(probs),):
        raise ValueError(f"probabilities must be [N, C >= 2] and targets [N]; got {probs.shape} and {true.shape}")
    if len(true) and (true.min() < 0 or true.max() >= probs.shape[1]):
        raise ValueError(f"targets must be class indices in 0..{probs.shape[1] - 1}")


def _numpy(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        values = values.float() if values.is_floating_point() and values.dtype != torch.float64 else values
        return values.numpy()
    return np.asarray(values)


def _floats(values) -> np.ndarray:
    return _numpy(values).astype(np.float64, copy=False)


def _classes(values) -> np.ndarray:
    return _numpy(values).astype(np.int64, copy=False)
