"""The training loop keeps Python's garbage collector off what setup built (core/training/garbage_collection.py):
during the loop the model, the optimizer and the imported libraries are frozen, so a full collection walks only what
the loop made; after it they are collectable again."""

from __future__ import annotations

import gc

from core.training.callbacks import Callback
from tests.support.checkpoint_harness import TINY
from tests.support.helpers import train_run, validated_config


class _Census(Callback):
    """At each step's end: how many objects are frozen, how many a full collection would walk, and whether the
    model and the optimizer are among the walked."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, run, step, micro_batches, record):
        walked = {id(o) for o in gc.get_objects()}
        held = [run.parallel.model, run.optimizer, *run.parallel.model.modules()]
        self.seen.append((gc.get_freeze_count(), len(walked), any(id(o) in walked for o in held)))


def test_setup_is_frozen_during_the_loop_and_collectable_after_it(tmp_path):
    census = _Census()
    cfg = validated_config("vit_sanity", [*TINY, "training.steps=2", f"checkpoint.path={tmp_path}/ckpt"])
    assert gc.get_freeze_count() == 0
    train_run(cfg, tmp_path / "run", callbacks=(census,))
    assert len(census.seen) == 2
    for frozen, walked, model_walked in census.seen:
        assert not model_walked  # setup's objects out of the collector's reach
        assert frozen > 10 * walked, (frozen, walked)  # most of the heap is setup's
    assert gc.get_freeze_count() == 0  # unfrozen when the loop ends
