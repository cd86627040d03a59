"""Python's garbage collector kept off what setup built, for the length of the training loop.

A full (oldest-generation) collection walks every object the process tracks: the imported libraries, the
model's modules, the configs, millions of them, while every thread of the process waits, the one that queues the
GPU's work among them. The loop's own allocations trigger such collections from time to time, mid-step, and the
GPU runs dry while one lasts; the more Python objects a step makes (decoding JPEGs where the model trains makes
many), the more often. gc.freeze() moves what exists when the loop starts out of the collector's reach: later
collections walk only what was made since. Objects that refcounting frees are freed as before; a reference cycle
dropped during the loop among frozen objects waits until the loop ends (`unfreeze`). docs/performance.md shows
what it saves.
"""

from __future__ import annotations

import gc


def freeze_setup() -> None:
    """Collect once, then freeze every object alive: collections until `unfreeze` skip them."""
    gc.collect()
    gc.freeze()


def unfreeze() -> None:
    """Back in the collector's reach, so that a caller who runs several trainings in one process (tests, notebooks)
    gets the first one's cycles collected."""
    gc.unfreeze()
