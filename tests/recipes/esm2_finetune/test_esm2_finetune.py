"""The ESM-2 fine-tuning recipe: labels aligned through packing and cropping, packed = padded per task, the
shipped sanity task reproducible, each head learning it on 2 processes, predict.py's rows."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.data.checks import assert_dataset_deterministic
from core.data.datasets import EpochIndex
from core.data.fingerprint import data_fingerprint
from core.layers.namespace import TORCH_LAYERS
from recipes.esm2.masking import IGNORE
from recipes.esm2_finetune.config import Task
from recipes.esm2_finetune.data import LabelledPacks, TargetCoding
from recipes.esm2_finetune.labels import LabelledSequences

REPO = Path(__file__).resolve().parents[3]
SANITY = REPO / "data" / "esm2_finetune_sanity"
TASKS = {
    "regression": ["data.label_columns=[hydrophobic_fraction,net_charge]"],
    "classification": ["model.task=classification", "data.label_columns=[charge_class]"],
    "multilabel": ["model.task=multilabel", "data.label_columns=[glyco_motif,cys_pair,proline_rich]"],
    "residue_classification": ["model.task=residue_classification", "data.label_columns=[structure]"],
}
TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64"]


def recipe_of(overrides: list[str]):
    from recipes.esm2_finetune.recipe import ESM2FinetuneRecipe
    from tests.support.helpers import validated_config

    cfg = validated_config("esm2_finetune_sanity", ["checkpoint.path=unused", *overrides])
    return ESM2FinetuneRecipe(ESM2FinetuneRecipe.resolve_config(cfg, is_main=False))


def stack(dataset, indices) -> dict:
    items = [dataset[i] for i in indices]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def letter_store(n=12, seed=0, longest=50) -> LabelledSequences:
    """Sequences whose residue label is the residue itself (class index = its token id - 4): alignment is visible."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest, n)
    residues = rng.integers(4, 24, int(lengths.sum())).astype(np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    targets = (residues.astype(np.int16) - 4).copy()
    targets[::7] = -1  # some residues unlabelled
    return LabelledSequences("test", [f"s{i}" for i in range(n)], residues, offsets, targets, tuple("x" * 20))


def test_residue_labels_stay_with_their_residues_through_packing_and_random_crops():
    store = letter_store()
    coding = TargetCoding(Task.residue_classification, 20)
    packs = LabelledPacks(store, np.arange(12), 64, 20, 8, coding, seed=3, shuffle_seed=5, random_crop=True)
    starts = set()
    for epoch in (0, 1):
        for k in range(len(packs)):
            item = packs[EpochIndex(epoch, k)]
            labelled = item["labels"] >= 0
            assert torch.equal(item["labels"][labelled], item["tokens"][labelled] - 4)
            assert labelled.sum() > 0 and (item["weights"] == labelled.float()).all()
            cu, sequences = item["cu_seqlens"].tolist(), item["sequences"]
            for slot, i in enumerate(sequences[sequences >= 0].tolist()):
                window = item["tokens"][cu[slot] + 1 : cu[slot + 1] - 1].numpy()
                full = store.sequence(i)
                start = next(
                    s for s in range(len(full) - len(window) + 1) if (full[s : s + len(window)] == window).all()
                )
                starts.add((i, epoch, start))
                unlabelled = store.targets[store.offsets[i] + start : store.offsets[i] + start + len(window)] < 0
                assert (item["labels"][cu[slot] + 1 : cu[slot + 1] - 1][torch.from_numpy(unlabelled)] == IGNORE).all()
    assert any(start > 0 for _, _, start in starts)  # some windows were cropped at random
    assert_dataset_deterministic(packs, [EpochIndex(e, k) for e in (0, 3) for k in range(len(packs))])
    fixed = LabelledPacks(store, np.arange(12), 64, 20, 8, coding, seed=3, shuffle_seed=None, random_crop=False)
    first = fixed[0]
    assert torch.equal(first["tokens"][1:19], torch.from_numpy(store.sequence(0)[:18].astype(np.int64)))


def test_a_changed_label_or_sequence_changes_the_training_packs_fingerprint():
    """Two rows whose labels were swapped keep the regression statistics and the class names that the config
    records (model.target_mean, model.classes), so only the training set's fingerprint shows the change on resume
    (core/data/fingerprint.py)."""
    store = letter_store()
    coding = TargetCoding(Task.residue_classification, 20)

    def fingerprint(changed: LabelledSequences) -> int:
        return data_fingerprint(LabelledPacks(changed, np.arange(12), 64, 20, 8, coding, 3, 5, random_crop=True))

    same = fingerprint(store)
    assert same == fingerprint(letter_store()) > 0
    swapped = store.targets.copy()
    swapped[[1, 2]] = swapped[[2, 1]]
    assert (
        fingerprint(LabelledSequences("test", store.ids, store.residues, store.offsets, swapped, store.classes)) != same
    )
    edited = store.residues.copy()
    edited[3] = 4 + (edited[3] - 3) % 20
    assert (
        fingerprint(LabelledSequences("test", store.ids, edited, store.offsets, store.targets, store.classes)) != same
    )


@pytest.mark.parametrize("task", TASKS)
def test_the_sanity_datasets_are_deterministic(task):
    recipe = recipe_of([*TINY, *TASKS[task]])
    datasets = recipe.build_datasets()
    assert_dataset_deterministic(datasets.train, [EpochIndex(e, k) for e in (0, 2) for k in (0, 5, 17)])
    assert_dataset_deterministic(datasets.val)


@pytest.mark.parametrize("task", TASKS)
def test_packed_and_padded_rows_give_the_same_loss_and_metrics(task):
    """The validation sequences packed (several per row) and padded (one per row): the same summed loss, item count
    and task metrics, with a model whose head has learnt nothing special (random init, dropout off)."""
    torch.manual_seed(0)
    results = []
    for packing in ("true", "false"):
        recipe = recipe_of([*TINY, *TASKS[task], f"data.packing={packing}", "model.max_seq_length=64"])
        model = recipe.build_model(TORCH_LAYERS, torch.device("cpu")).eval()
        val = recipe.build_datasets().val
        batch = stack(val, range(len(val)))
        with torch.no_grad():
            out = recipe.forward(model, batch, training=False)
        items = out["items"]
        metrics = recipe.summarize_items(items)  # the items in file order, packed or padded
        results.append((len(val), out["loss"].sum(), out["count"].sum(), metrics, recipe.loss_count(batch)))
    (packed_rows, *packed), (padded_rows, *padded) = results
    assert packed_rows < padded_rows == 100
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=0)
    assert packed[1] == padded[1] == packed[3] == padded[3] > 0
    assert packed[2].keys() == padded[2].keys()
    for name in packed[2]:
        assert packed[2][name] == pytest.approx(padded[2][name], rel=1e-4, abs=1e-6), name


def test_the_script_reproduces_the_shipped_sanity_files(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_esm2_finetune_sanity.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for split in ("train", "val", "test"):
        assert (tmp_path / f"{split}.csv").read_bytes() == (SANITY / f"{split}.csv").read_bytes(), split


def trivial_figure(task: str, rows: list[dict], train: list[dict]) -> tuple[str, float, float]:
    """(metric, the model's figure on the val rows, the trivial predictor's: the training mean or majority)."""
    if task == "regression":
        names = ["hydrophobic_fraction", "net_charge"]
        truth = np.array([[float(r[f"true_{n}"]) for n in names] for r in rows])
        mean = np.array([[float(r[n]) for n in names] for r in train]).mean(0)
        r2 = 1 - ((truth - mean) ** 2).sum(0) / ((truth - truth.mean(0)) ** 2).sum(0)
        return "r2", None, float(r2.mean())
    if task == "classification":
        majority = max(set(r["charge_class"] for r in train), key=[r["charge_class"] for r in train].count)
        return "accuracy", None, float(np.mean([r["true_class"] == majority for r in rows]))
    if task == "multilabel":
        return "auroc", None, 0.5  # any constant score ranks positives and negatives at chance
    letters = "".join(r["structure"] for r in train)
    majority = max("CEH", key=letters.count)
    return "accuracy", None, float(np.mean([r["true_class"] == majority for r in rows]))


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_each_head_learns_the_sanity_task_on_two_processes(tmp_path, task):
    """esm2_finetune_sanity (a fresh tiny ESM-2) on 2 processes, then predict.py on the val split (2 processes): the
    task's metric clearly beats the trivial predictor's (the training mean or majority), both printed; the rows come
    in the val file's order."""
    from tests.support.helpers import run_python_ranks

    short = ["logger.progress_bar=never", f"checkpoint.path={tmp_path}/ckpt", *TASKS[task]]
    trained = run_python_ranks(
        2,
        REPO / "train.py",
        "--config-name",
        "esm2_finetune_sanity",
        "training.steps=60",
        "training.val_every_n_steps=0",  # validation at the end only
        f"hydra.run.dir={tmp_path}/run",
        *short,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    predicted = run_python_ranks(
        2,
        REPO / "predict.py",
        f"checkpoint.init_from={tmp_path}/ckpt/step_60",
        "predict.split=val",
        f"predict.output={tmp_path}/out/p.csv",
        f"hydra.run.dir={tmp_path}/predict",
        *short,
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    with open(tmp_path / "out" / "p.csv") as f:
        rows = list(csv.DictReader(f))
    with open(SANITY / "val.csv") as f:
        val = list(csv.DictReader(f))
    with open(SANITY / "train.csv") as f:
        train = list(csv.DictReader(f))
    if task == "residue_classification":
        expected = [(r["id"], i + 1, letter) for r in val for i, letter in enumerate(r["sequence"])]
        assert [(r["id"], int(r["position"]), r["residue"]) for r in rows] == expected
        assert [r["true_class"] for r in rows] == list("".join(r["structure"] for r in val))
    else:
        assert [r["id"] for r in rows] == [r["id"] for r in val]
    metric, _, trivial = trivial_figure(task, rows, train)
    from tests.support.helpers import read_records

    (validation,) = [r for r in read_records(tmp_path / "run") if r.get("split") == "val"]
    predicted_figure = json.loads((tmp_path / "out" / "prediction_metrics.json").read_text())[metric]
    print(f"{task}: validation {metric} {validation[metric]:.4f}, trivial predictor {trivial:.4f}")
    assert validation[metric] > trivial + (0.5 if metric == "r2" else 0.1)
    assert predicted_figure == pytest.approx(validation[metric], rel=1e-3)  # predict.py's rows: the same figure
