"""predict.py's side of the fine-tuning recipe: the model's outputs per pack, then one row per sequence (or per
residue) in input order, and the task's metrics where the file had labels.

Rows: sequence tasks `id`, then regression one column per target (named by it: the prediction, in the target's
units) and `true_<target>`; classification `class` (its name) and `prob_<class>` per class (and `true_class`);
multilabel `prob_<label>` per label, `labels` (the predicted ones, space-separated) and `true_labels`. The residue
task: one row per residue, `id`, `position` (1-based in the sequence), `residue`, `class`, `prob_<class>`, and
`true_class` (empty where unlabelled). With predict.embedding_layer set: `embedding_0..` (sequence tasks: the mean
hidden state over the sequence's residues after that many blocks; the residue task: each residue's).
Sequences longer than model.max_seq_length - 2 residues are predicted on their first window.
"""

from __future__ import annotations

import numpy as np
import torch

from core.metrics import task_metrics as metrics
from recipes.esm2.tokenizer import VOCABULARY
from recipes.esm2_finetune.config import SEQUENCE_TASKS, Task
from recipes.esm2_finetune.model import pool


def outputs(model_cfg, logits: torch.Tensor) -> torch.Tensor:
    """Logits -> what a user reads: regression predictions in the targets' units, else probabilities."""
    task = Task(model_cfg.task)
    if task is Task.regression:
        std = torch.tensor(model_cfg.target_std, device=logits.device)
        return logits * std + torch.tensor(model_cfg.target_mean, device=logits.device)
    return torch.sigmoid(logits) if task is Task.multilabel else torch.softmax(logits, dim=-1)


def predict(cfg, model, batch: dict) -> dict[str, torch.Tensor]:
    tokens, cu, sequences = batch["tokens"], batch["cu_seqlens"], batch["sequences"]
    per_sequence = Task(cfg.model.task) in SEQUENCE_TASKS
    logits = model(tokens, cu).float()
    columns = {"sequences": sequences, "cu_seqlens": cu}
    if per_sequence:
        columns["output"] = outputs(cfg.model, logits[:, : sequences.shape[1]])
    else:
        columns |= {"output": outputs(cfg.model, logits), "tokens": tokens}
    layer = cfg.predict.embedding_layer
    if layer is not None:
        hidden = model(tokens, cu, hidden_layer=min(layer, cfg.model.num_layers)).float()
        columns["embedding"] = pool(hidden, tokens, cu, cls=False)[:, : sequences.shape[1]] if per_sequence else hidden
    return columns


def finish(model_cfg, packs, columns: dict[str, torch.Tensor]) -> dict:
    """Pack slots (or tokens) -> rows in the input's order."""
    present = columns["sequences"] >= 0
    index = columns["sequences"][present]
    order = torch.argsort(index)
    store, classes, task = packs.store, list(model_cfg.classes), Task(model_cfg.task)
    if task is not Task.residue_classification:
        chosen = {k: v[present][order] for k, v in columns.items() if k in ("output", "embedding")}
        return sequence_rows(task, classes, store, index[order], chosen)
    return residue_rows(classes, store, columns, index, order)


def sequence_rows(task: Task, classes: list[str], store, index: torch.Tensor, chosen: dict) -> dict:
    ids, out = index.tolist(), chosen["output"]
    rows: dict = {"id": [store.name(i) for i in ids]}
    truth = store.targets[ids] if store.targets is not None else None
    if task is Task.regression:
        for k, name in enumerate(classes):
            rows[name] = out[:, k]
            if truth is not None:
                rows[f"true_{name}"] = torch.from_numpy(truth[:, k].astype(np.float64))
    elif task is Task.classification:
        rows["class"] = [classes[c] for c in out.argmax(dim=1).tolist()]
        rows |= {f"prob_{name}": out[:, k] for k, name in enumerate(classes)}
        if truth is not None:
            rows["true_class"] = [classes[c] for c in truth.tolist()]
    else:
        rows |= {f"prob_{name}": out[:, k] for k, name in enumerate(classes)}
        rows["labels"] = [" ".join(c for c, on in zip(classes, row) if on) for row in (out > 0.5).tolist()]
        if truth is not None:
            rows["true_labels"] = [" ".join(c for c, on in zip(classes, row) if on) for row in (truth > 0.5).tolist()]
    if "embedding" in chosen:
        rows["embedding"] = chosen["embedding"]
    return rows


def residue_rows(classes: list[str], store, columns: dict, index: torch.Tensor, order: torch.Tensor) -> dict:
    """One row per residue of each sequence's (first) window, sequences in input order."""
    where = torch.nonzero(columns["sequences"] >= 0)[order]  # (pack, slot) of each sequence, in input order
    rows: dict = {"id": [], "position": [], "residue": [], "class": [], "true_class": []}
    out, pieces, embedding = columns["output"], [], []
    for (pack, slot), i in zip(where.tolist(), index[order].tolist()):
        start, end = columns["cu_seqlens"][pack, slot].item() + 1, columns["cu_seqlens"][pack, slot + 1].item() - 1
        n = end - start
        rows["id"] += [store.name(i)] * n
        rows["position"] += range(1, n + 1)
        rows["residue"] += [VOCABULARY[t] for t in columns["tokens"][pack, start:end].tolist()]
        pieces.append(out[pack, start:end])
        if "embedding" in columns:
            embedding.append(columns["embedding"][pack, start:end])
        if store.targets is not None:
            first = int(store.offsets[i])
            rows["true_class"] += [classes[c] if c >= 0 else "" for c in store.targets[first : first + n].tolist()]
    probabilities = torch.cat(pieces) if pieces else out.new_zeros(0, len(classes))
    rows["class"] = [classes[c] for c in probabilities.argmax(dim=1).tolist()]
    rows |= {f"prob_{name}": probabilities[:, k] for k, name in enumerate(classes)}
    if store.targets is None:
        del rows["true_class"]
    if embedding:
        rows["embedding"] = torch.cat(embedding)
    return rows


def task_metrics(model_cfg, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """The task's metrics of items (core/metrics/task_metrics.py): output (regression: standardised predictions, taken
    back to the targets' units with the target; else probabilities), target (regression: standardised)."""
    task = Task(model_cfg.task)
    output = output.double()
    if task is Task.regression:
        std, mean = torch.tensor(model_cfg.target_std).double(), torch.tensor(model_cfg.target_mean).double()
        return metrics.task_metrics(task.value, output * std + mean, target.double() * std + mean)
    return metrics.task_metrics(task.value, output, target.long())


def summarize(model_cfg, rows: dict) -> dict[str, float | int]:
    """The task's metrics over the rows whose input had labels; the row count alone without labels."""
    task, classes = Task(model_cfg.task), list(model_cfg.classes)
    summary: dict = {"sequences": len(set(rows["id"])) if task is Task.residue_classification else len(rows["id"])}
    if task is Task.regression:
        if f"true_{classes[0]}" not in rows:
            return summary
        output = torch.stack([rows[name].double() for name in classes], 1)
        truth = torch.stack([rows[f"true_{name}"].double() for name in classes], 1)
        return summary | metrics.task_metrics(task.value, output, truth)
    truth_key = "true_labels" if task is Task.multilabel else "true_class"
    if truth_key not in rows:
        return summary
    output = torch.stack([rows[f"prob_{name}"].double() for name in classes], 1)
    if task is Task.multilabel:
        truth = torch.tensor([[c in set(t.split()) for c in classes] for t in rows[truth_key]], dtype=torch.long)
    else:  # rows without a label (an unlabelled residue) left out
        known = [k for k, t in enumerate(rows[truth_key]) if t != ""]
        output, truth = output[known], torch.tensor([classes.index(rows[truth_key][k]) for k in known])
    return summary | metrics.task_metrics(task.value, output, truth.long())
