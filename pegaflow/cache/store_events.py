"""What happens to blocks in L1, told to whoever needs it: the tiers below L1
(write-behind on seal, spill on eviction, advertising what is held), the miss
breakdown (saves refused for want of a slot) and the namespace reaper.

A listener subclasses StoreListener and overrides only the events it needs;
BlockStore.add_listener keeps, per event, the bound methods that were
overridden, so an event nobody listens to costs one empty loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pegaflow.common.keys import Key, Namespace

if TYPE_CHECKING:
    from .block_entry import BlockEntry

EVENTS = (
    "sealed",
    "ready",
    "hit",
    "evicting",
    "removed",
    "emptied",
    "pool_full",
    "awaited",
    "unchecked_evicted",
)


class StoreListener:
    def sealed(self, entries: list[BlockEntry]) -> None:
        """A save made these blocks ready (every layer of every shard landed)."""

    def ready(self, entries: list[BlockEntry]) -> None:
        """These blocks became ready, from a save, a lower tier's load or a
        warm restart's adoption."""

    def hit(self, entries: list[BlockEntry]) -> None:
        """These ready blocks were hit by a query (after the policy heard)."""

    def evicting(self, entries: list[BlockEntry]) -> np.ndarray | None:
        """L1 evicts these ready blocks of one namespace (one eviction round).
        True where this listener keeps their slots (it frees them through the
        allocator later, once it has read them); None keeps none."""
        return None

    def removed(self, keys: list[Key]) -> None:
        """Ready blocks that left L1 (evicted, or their namespace freed)."""

    def emptied(self, ns: Namespace) -> None:
        """The namespace's last entry (ready, in flight or pinned) went."""

    def pool_full(self, keys: list[Key]) -> None:
        """Saves of these keys were refused for want of a free slot."""

    def awaited(self, entries: list[BlockEntry]) -> None:
        """A save waits for these blocks, which another writer (a save, a load,
        a restart's check) had in flight: whoever brings them in may hurry."""

    def unchecked_evicted(self, keys: list[Key]) -> None:
        """A restart's recovered blocks, not checked yet, evicted for room:
        their check is moot (their slots are freed next)."""


def overridden(listener: StoreListener) -> list[str]:
    """The events a listener overrides, in EVENTS order."""
    cls = type(listener)
    return [e for e in EVENTS if getattr(cls, e) is not getattr(StoreListener, e)]
