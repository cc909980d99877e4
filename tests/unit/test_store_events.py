"""BlockStore's listener list (pegaflow.cache.store_events): each listener hears
the events it overrides, in the order listeners were added, and an eviction
keeps the slots any listener keeps."""

from __future__ import annotations

import numpy as np

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.cache.store_events import EVENTS, StoreListener, overridden
from pegaflow.common.keys import Namespace

SLOT = 4096
NS = Namespace("ns", 1, 1, 1, SLOT, (1, SLOT))


def _h(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in ids]


def _save(store: BlockStore, hashes: list[bytes]) -> None:
    store.finish_save(store.reserve_save(NS, 0, hashes, np.arange(1)), True)


class Recorder(StoreListener):
    """Hears everything; keeps the slots of the evicted blocks in `keep`."""

    def __init__(self, name: str, log: list, keep: set[bytes] = frozenset()) -> None:
        self.name, self.log, self.keep = name, log, keep

    def sealed(self, entries) -> None:
        self.log.append((self.name, "sealed", [e.key[1] for e in entries]))

    def ready(self, entries) -> None:
        self.log.append((self.name, "ready", [e.key[1] for e in entries]))

    def hit(self, entries) -> None:
        self.log.append((self.name, "hit", [e.key[1] for e in entries]))

    def evicting(self, entries) -> np.ndarray:
        self.log.append((self.name, "evicting", [e.key[1] for e in entries]))
        return np.array([e.key[1] in self.keep for e in entries], bool)

    def removed(self, keys) -> None:
        self.log.append((self.name, "removed", [k[1] for k in keys]))

    def emptied(self, ns) -> None:
        self.log.append((self.name, "emptied", ns.id))

    def pool_full(self, keys) -> None:
        self.log.append((self.name, "pool_full", [k[1] for k in keys]))

    def awaited(self, entries) -> None:
        self.log.append((self.name, "awaited", [e.key[1] for e in entries]))

    def unchecked_evicted(self, keys) -> None:
        self.log.append((self.name, "unchecked_evicted", [k[1] for k in keys]))


class SealsOnly(StoreListener):
    def __init__(self, log: list) -> None:
        self.log = log

    def sealed(self, entries) -> None:
        self.log.append(("seals", "sealed", [e.key[1] for e in entries]))


def test_a_listener_hears_only_what_it_overrides() -> None:
    assert overridden(StoreListener()) == []
    assert overridden(SealsOnly([])) == ["sealed"]
    assert overridden(Recorder("r", [])) == list(EVENTS)


def test_events_reach_listeners_in_the_order_they_were_added() -> None:
    store = BlockStore(SlabAllocator(1 << 30, 2 * SLOT, SLOT), LRUPolicy())
    log: list = []
    store.add_listener(SealsOnly(log))
    store.add_listener(Recorder("a", log))
    _save(store, _h(1))
    assert log == [("seals", "sealed", _h(1)), ("a", "sealed", _h(1)),
                   ("a", "ready", _h(1))]  # fmt: skip
    log.clear()
    store.lookup(NS, _h(1))
    store.apply_touches()
    assert log == [("a", "hit", _h(1))]


def test_an_eviction_keeps_the_slots_any_listener_keeps() -> None:
    """A full pool of three; two listeners keep one victim each. Saving a
    fourth block evicts 1 (kept by a), then 2 (kept by b), then 3 (kept by
    none, freed): the new block gets 3's slot and 1's and 2's stay allocated."""
    store = BlockStore(SlabAllocator(1 << 30, 3 * SLOT, SLOT), LRUPolicy())
    log: list = []
    store.add_listener(Recorder("a", log, keep={_h(1)[0]}))
    store.add_listener(Recorder("b", log, keep={_h(2)[0]}))
    _save(store, _h(1, 2, 3))
    log.clear()
    _save(store, _h(4))
    rounds = [e for e in log if e[1] == "evicting"]
    assert rounds == [("a", "evicting", _h(1)), ("b", "evicting", _h(1)),
                      ("a", "evicting", _h(2)), ("b", "evicting", _h(2)),
                      ("a", "evicting", _h(3)), ("b", "evicting", _h(3))]  # fmt: skip
    assert ("a", "removed", _h(3)) in log and ("b", "removed", _h(1)) in log
    assert store.slabs.used_bytes == 3 * SLOT  # 1 and 2 kept, 4 in 3's slot
    assert len(store.longest_prefix(NS, _h(4))) == 1
    assert store.longest_prefix(NS, _h(1)) == []
