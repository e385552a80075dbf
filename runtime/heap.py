"""The process's warm heap, moved out of the garbage collector's reach once a process is warm.

A warm rollout or trainer process holds ~0.5M Python objects (torch, transformers, compiled code,
graphs, optimiser state) that live as long as it does, and each full collection walks all of them:
~0.2 s on a 2-core CPU, a pause that leaves the GPU idle (~0.28 s per 1.5B ``rl`` rollout on an
H100, docs/benchmarks.md stop 32). Frozen (``gc.freeze``), they are skipped. One owner at a time
freezes: the first engine or run loop of a process to get warm; it thaws at its end, so a process
that builds and drops engines or loops (tests, notebooks) does not keep their reference cycles.
"""

from __future__ import annotations

import gc

_frozen = False  # by an owner still open


def freeze_warm_heap() -> bool:
    """Collect once, then move every live object into the collector's permanent generation;
    returns whether this call froze (False: an owner already has)."""
    global _frozen
    if _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    return True


def thaw_heap() -> None:
    """Undo ``freeze_warm_heap`` (the frozen objects go back to the oldest generation)."""
    global _frozen
    gc.unfreeze()
    _frozen = False
