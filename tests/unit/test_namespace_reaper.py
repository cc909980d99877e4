"""NamespaceReaper over the real store, leases and hit-rate tracker: when a
namespace goes, and what an idle one keeps."""

from __future__ import annotations

import numpy as np

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.instances import Instance, Registry
from pegaflow.cache.leases import LeaseTable
from pegaflow.cache.miss_reasons import HitRateTracker
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.keys import Namespace
from pegaflow.common.settings import HitRateConfig
from pegaflow.server.namespaces import NamespaceReaper

SLOT = 4096


class World:
    def __init__(self, max_idle: int = 8, slots: int = 16) -> None:
        self.registry = Registry({})
        self.store = BlockStore(SlabAllocator(1 << 30, slots * SLOT, SLOT), LRUPolicy())
        self.leases = LeaseTable(self.store, 30.0)
        self.hit_rates = HitRateTracker(HitRateConfig((60.0,), 4), ghost_bits=16)
        self.reaper = NamespaceReaper(
            self.registry, self.store, self.leases, self.hit_rates, [], max_idle
        )

    def join(self, name: str, ident: int) -> Namespace:
        ns = Namespace(name, ident, 1, 1, SLOT, (1, SLOT))
        self.registry.namespaces[name] = ns
        return self.back(ns)

    def back(self, ns: Namespace) -> Namespace:
        """An engine (instance named as its namespace) registers in ns."""
        # _in_use only asks whether the instance has workers.
        self.registry.instances[ns.name] = Instance(ns.name, ns, 1, 1, {0: object()})
        self.reaper.joined(ns)
        return ns

    def leave(self, ns: Namespace) -> None:
        del self.registry.instances[ns.name]
        self.reaper.left(ns)

    def save(self, ns: Namespace, hashes: list[bytes], ok: bool = True) -> None:
        self.store.finish_save(self.reserve(ns, hashes), ok)

    def reserve(self, ns: Namespace, hashes: list[bytes]) -> object:
        return self.store.reserve_save(ns, 0, hashes, np.arange(1))


def _h(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in ids]


def test_in_flight_save_keeps_the_namespace_until_it_fails() -> None:
    """An engine leaves (killed) while its save is in flight: its namespace
    holds reserved entries, so it stays; when the copy fails and the entries
    go, the namespace goes with them."""
    w = World()
    ns = w.join("ns-a", 1)
    res = w.reserve(ns, _h(1, 2))
    w.leave(ns)
    assert "ns-a" in w.registry.namespaces and w.reaper.idle == 1
    w.store.finish_save(res, False)
    assert "ns-a" not in w.registry.namespaces and w.reaper.idle == 0
    assert not w.store.holds(ns.id)


def test_idle_namespace_goes_with_its_last_evicted_block() -> None:
    """ns-a's engine left with one block resident; ns-b's saves evict it."""
    w = World(slots=4)
    a, b = w.join("ns-a", 1), w.join("ns-b", 2)
    w.save(a, _h(1))
    w.leave(a)
    assert "ns-a" in w.registry.namespaces
    w.save(b, _h(10, 11, 12, 13))  # a full pool: ns-a's block is the LRU victim
    assert "ns-a" not in w.registry.namespaces
    assert "ns-b" in w.registry.namespaces and w.store.holds(b.id)


def test_registered_namespace_stays_when_its_blocks_go() -> None:
    w = World(slots=2)
    a, b = w.join("ns-a", 1), w.join("ns-b", 2)
    w.save(a, _h(1))
    w.save(b, _h(10, 11))  # evicts ns-a's only block; an engine is still in ns-a
    assert not w.store.holds(a.id) and "ns-a" in w.registry.namespaces


def test_idle_bound_drops_the_longest_idle_hit_rates_first() -> None:
    w = World(max_idle=1)
    a, b = w.join("ns-a", 1), w.join("ns-b", 2)
    for ns in (a, b):
        w.save(ns, _h(ns.id))
        w.hit_rates.query(ns, _h(ns.id, 99), 1, np.zeros(1, bool))
    w.hit_rates.flush()
    w.leave(a)
    assert a.id in w.hit_rates and w.reaper.idle == 1
    w.leave(b)  # two idle, one allowed: ns-a (idle the longest) loses its state
    assert a.id not in w.hit_rates and b.id in w.hit_rates
    assert {"ns-a", "ns-b"} <= set(w.registry.namespaces)  # blocks still there
    w.back(a)  # an engine is back: ns-a is no longer idle
    assert w.reaper.idle == 1
