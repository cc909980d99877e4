"""Keep full garbage collections short when the block index is large.

Every resident block is a few GC-tracked objects (its entry, its slot list), so
a server holding a million blocks has ~2M of them, and CPython's full (gen-2)
collection walks them all: ~400 ms on the dev VM, stalling the event loop —
every query and save — each time block churn has grown the heap by a quarter
(every ~100 saves of 2560 blocks; measured by a benchmark since retired:
`git show 0ab4978:benchmarks/gc_pauses.py`).

After each full collection its survivors are frozen (gc.freeze): later
collections walk only objects created since (5-13 ms in the same benchmark).
Frozen objects are still freed by reference counting, which is how evicted
blocks go (the index holds no cycles); what this gives up is reclaiming cycles
that form among objects which already survived a full collection.
"""

from __future__ import annotations

import gc

_installed = False


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


def install() -> None:
    """Idempotent; the server calls it once at start."""
    global _installed
    if not _installed:
        gc.callbacks.append(_freeze_survivors)
        _installed = True


def uninstall() -> None:
    global _installed
    if _installed:
        gc.callbacks.remove(_freeze_survivors)
        _installed = False
