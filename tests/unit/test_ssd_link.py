"""SsdLink bookkeeping against a scripted tier (no files, no bytes): slots of a
spill stay allocated until release, one load per missing prefix, partial loads."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.instances import Registry
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.keys import Namespace
from pegaflow.gds import SsdLoadResult
from pegaflow.server.metrics import Metrics
from pegaflow.tiers.ssd_link import SsdLink

SLOT = 4096


class FakeTier:
    """Queues up to `queue` spills (never written: the test releases them);
    holds loads until the test completes them."""

    config = SimpleNamespace(write_on="evict", admission="all")

    def __init__(self, queue: int = 2) -> None:
        self.spills: list[tuple[bytes, np.ndarray, object]] = []
        self.loads: list[tuple[list[bytes], np.ndarray, Future[SsdLoadResult]]] = []
        self.on_ssd: set[bytes] = set()
        self.queue = queue
        self.calls = 0  # tier calls: one per eviction round, not per block
        self.refused: list[bytes] = []  # offered while the queue was full

    def spill_many(
        self,
        ns: bytes,
        hashes: list[bytes],
        slots: np.ndarray,
        each: int,
        release: Callable[[int, int], None],
    ) -> list[int]:
        self.calls += 1
        took = []
        for i, h in enumerate(hashes):
            if h in self.on_ssd or len(self.spills) == self.queue:
                continue  # on SSD already, or queue full: dropped
            pos = len(took)
            self.spills.append((h, slots[i], functools.partial(release, pos, pos + 1)))
            self.on_ssd.add(h)
            took.append(i)
        return took

    def queue_room(self) -> int:
        return self.queue - len(self.spills)

    def refuse_many(self, ns: bytes, hashes: list[bytes]) -> None:
        self.calls += 1
        self.refused += hashes

    def lookup(self, ns: bytes, hashes: list[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.on_ssd:
            n += 1
        return n

    def load(
        self, ns: bytes, hashes: list[bytes], slots: np.ndarray, each: int
    ) -> Future[SsdLoadResult]:
        fut: Future[SsdLoadResult] = Future()
        self.loads.append((list(hashes), slots, fut))
        return fut


def _h(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in ids]


def _setup(slots: int) -> tuple[BlockStore, SsdLink, FakeTier, Namespace]:
    store = BlockStore(SlabAllocator(1 << 30, slots * SLOT, SLOT), LRUPolicy())
    ns = Namespace("ns", 1, 1, 2, SLOT, (2, SLOT))
    registry = Registry({})
    registry.namespaces["ns"] = ns
    tier = FakeTier()
    link = SsdLink(tier, store, registry, Metrics().ssd, max_held_bytes=1 << 30)
    store.add_listener(link)
    return store, link, tier, ns


def _save(store: BlockStore, ns: Namespace, hashes: list[bytes]) -> int:
    layers = np.arange(ns.num_layers)
    res = store.reserve_save(ns, 0, hashes, layers)
    store.finish_save(res, True)
    return len(res.keys)


async def _spill_holds_slots_until_release() -> None:
    store, link, tier, ns = _setup(4)
    assert _save(store, ns, _h(1, 2, 3, 4)) == 4
    # Pool full: victims 1 and 2 go to the tier with their slots; the queue is
    # then full, so victim 3 is dropped and its slot serves the save.
    assert _save(store, ns, _h(5)) == 1
    assert [h for h, _, _ in tier.spills] == _h(1, 2)
    assert store.slabs.used_bytes == 4 * SLOT  # spilled slots still allocated
    assert store.slabs.free_slots(ns.slot_class) == 0
    assert len(store.longest_prefix(ns, _h(4, 5))) == 2
    for _, _, release in tier.spills:
        release()  # as a writer thread would, once the bytes are copied out
    assert store.slabs.used_bytes == 4 * SLOT  # the free runs on the loop
    await asyncio.sleep(0)
    assert store.slabs.used_bytes == 2 * SLOT
    # Held slots are bounded too: with one slot's worth allowed, the second
    # victim is refused by the link even though the tier has room.
    link._max_held, tier.spills = SLOT, []
    assert _save(store, ns, _h(6, 7, 8)) == 3
    assert [h for h, _, _ in tier.spills] == _h(4)  # 5 refused, its slot freed


async def _one_round_one_job() -> None:
    """Regression (issue 13): a save that evicts many blocks at once handed
    them to the tier one by one (a lookup and a spill per victim on the loop,
    ~10 us each); now the round's victims go as one job. With the queue full,
    they are refused in one call that needs no slot table (a save burst the
    disk cannot absorb), and those written before and those dropped alike
    free their slots at once."""
    store, link, tier, ns = _setup(8)
    assert _save(store, ns, _h(*range(1, 9))) == 8
    tier.queue, tier.on_ssd = 0, set(_h(2, 4))
    assert _save(store, ns, _h(*range(11, 17))) == 6  # one round of 6 victims
    assert tier.calls == 1 and not tier.spills
    assert tier.refused == _h(*range(1, 7))
    assert store.slabs.used_bytes == 8 * SLOT and link._held == 0
    assert len(store.longest_prefix(ns, _h(7, 8, *range(11, 17)))) == 8


def test_one_eviction_round_is_one_tier_job() -> None:
    asyncio.run(_one_round_one_job())


async def _one_load_per_prefix() -> None:
    store, link, tier, ns = _setup(8)
    tier.on_ssd.update(_h(2, 3, 4))
    assert _save(store, ns, _h(1)) == 1
    hits, _ = store.lookup(ns, _h(1, 2, 3, 4))
    assert link.loading(ns, _h(1, 2, 3, 4), len(hits)) == (3, True)
    assert link.loading(ns, _h(1, 2, 3, 4), 1) == (3, False)  # no second load
    assert link.loading(ns, _h(3, 4), 0) == (2, False)
    assert len(tier.loads) == 1
    assert _save(store, ns, _h(2)) == 0  # being loaded: a save deduplicates
    hashes, slots, fut = tier.loads[0]
    assert hashes == _h(2, 3, 4) and len(np.unique(slots)) == 3
    fut.set_result(SsdLoadResult(np.array([True, False, True]), 2 * SLOT, 0.01))
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(store.longest_prefix(ns, _h(1, 2, 3, 4))) == 2  # 3 failed
    assert len(store.longest_prefix(ns, _h(4))) == 1  # arrived: ready
    assert store.slabs.used_bytes == 3 * SLOT  # the failed block's slot is back
    assert not link._loading


def test_spill_holds_slots_until_release() -> None:
    asyncio.run(_spill_holds_slots_until_release())


def test_one_load_per_prefix_and_partial_results() -> None:
    asyncio.run(_one_load_per_prefix())


async def _seal_at_a_full_queue() -> None:
    """Write-behind when the queue is full (a save burst the disk cannot
    absorb): the sealed blocks past the queue's room are refused in one call,
    with no slot table, and under seen_twice admission they are offered again
    at their next hit, where the queue has room."""
    store = BlockStore(SlabAllocator(1 << 30, 8 * SLOT, SLOT), LRUPolicy())
    ns = Namespace("ns", 1, 1, 2, SLOT, (2, SLOT))
    registry = Registry({})
    registry.namespaces["ns"] = ns
    tier = FakeTier(queue=0)
    tier.config = SimpleNamespace(write_on="seal", admission="seen_twice")
    link = SsdLink(tier, store, registry, Metrics().ssd, max_held_bytes=1 << 30)
    store.add_listener(link)
    assert _save(store, ns, _h(1, 2, 3)) == 3
    assert tier.refused == _h(1, 2, 3) and tier.calls == 1 and not tier.spills
    assert set(link._unwritten) == {(ns.id, h) for h in _h(1, 2, 3)}
    tier.queue = 8
    hits, _ = store.lookup(ns, _h(1, 2))
    store.apply_touches()
    assert len(hits) == 2
    assert [h for h, _, _ in tier.spills] == _h(1, 2)
    assert set(link._unwritten) == {(ns.id, _h(3)[0])}
    assert list(link._writing) == [(ns.id, h) for h in _h(1, 2)]
    # Room for one more: the first sealed block is queued, the rest refused.
    tier.queue, tier.refused = len(tier.spills) + 1, []
    assert _save(store, ns, _h(4, 5, 6)) == 3
    assert [h for h, _, _ in tier.spills] == _h(1, 2, 4)
    assert tier.refused == _h(5, 6)


def test_seal_at_a_full_queue_refuses_then_offers_again_at_a_hit() -> None:
    asyncio.run(_seal_at_a_full_queue())


async def _write_behind_within_the_held_bound() -> None:
    """Regression: blocks queued for write-behind that L1 evicted before the
    writer got to them kept their slots past the held-bytes bound (only
    spills checked it), so a slow disk could hold the whole pool. Now a
    seal's block is written behind only within the bound; past it the seal
    is refused (counted) and the block is spilled at its eviction if there
    is room then."""
    store = BlockStore(SlabAllocator(1 << 30, 8 * SLOT, SLOT), LRUPolicy())
    ns = Namespace("ns", 1, 1, 2, SLOT, (2, SLOT))
    registry = Registry({})
    registry.namespaces["ns"] = ns
    tier = FakeTier(queue=64)
    tier.config = SimpleNamespace(write_on="seal", admission="all")
    metrics = Metrics()
    link = SsdLink(tier, store, registry, metrics.ssd, max_held_bytes=3 * SLOT)
    store.add_listener(link)
    assert _save(store, ns, _h(*range(1, 9))) == 8  # the pool is full
    # The next save evicts 1..4: 1..3 are still being written (their slots
    # stay held), 4 finds no room under the bound: its slot frees at once.
    # (Before, all 8 were held and this save found no slot at all.)
    assert _save(store, ns, _h(11)) == 1
    assert link._held <= link._max_held
    assert [h for h, _, _ in tier.spills] == _h(1, 2, 3)  # within the bound
    refused = "pegaflow_ssd_spills_refused_total"
    # seals of 4..8 and 11, the spill of 4
    assert metrics.registry.get_sample_value(refused) == 7
    assert store.slabs.used_bytes == 8 * SLOT
    assert _save(store, ns, _h(12, 13, 14)) == 3
    assert link._held <= link._max_held
    assert store.slabs.used_bytes <= 8 * SLOT
    for _, _, release in tier.spills:
        release()
    await asyncio.sleep(0)
    assert link._held == 0 and not link._writing


def test_write_behind_stays_within_the_held_bound() -> None:
    asyncio.run(_write_behind_within_the_held_bound())
