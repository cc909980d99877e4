"""A pool whose blocks are all pinned: once the policy's pass came back short,
later saves skip it until a block is published or unpinned
(pegaflow.cache.slot_eviction), and then evict again at once."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from pegaflow.cache.block_entry import SaveReservation
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import AdmissionPolicy, LRUPolicy, TinyLFU
from pegaflow.cache.leases import Lease, LeaseTable
from pegaflow.cache.prefix_eviction import PrefixLRUPolicy
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.keys import Namespace

SLAB = 256 << 10
SLOT = 16 << 10
SLABS = 4
RESIDENT = SLABS * SLAB // SLOT  # the pool's blocks

POLICIES: dict[str, Callable] = {
    "lru": LRUPolicy,
    "prefix": PrefixLRUPolicy,
    "tinylfu": lambda: AdmissionPolicy(LRUPolicy(), TinyLFU(RESIDENT)),
}


def _h(tag: str, i: int) -> bytes:
    return tag.encode().ljust(28, b".") + i.to_bytes(4, "big")


def _reserve(store: BlockStore, ns: Namespace, tag: str, n: int) -> SaveReservation:
    return store.reserve_save(ns, 0, [_h(tag, i) for i in range(n)], np.arange(1))


def _save(store: BlockStore, ns: Namespace, tag: str, n: int) -> int:
    """Blocks stored of a save of n new ones."""
    res = _reserve(store, ns, tag, n)
    store.finish_save(res, True)
    return len(res.keys)


def _save_admitted(store: BlockStore, ns: Namespace, tag: str, n: int) -> int:
    """As _save, the blocks resident after; asked again while TinyLFU's
    admission refuses some: each ask counts, until the new blocks out-count
    the residents they displace."""
    for _ in range(8):
        rejected = store.counters.admission_rejections
        _save(store, ns, tag, n)
        if store.counters.admission_rejections == rejected:
            return sum((ns.id, _h(tag, i)) in store.entries for i in range(n))
    raise AssertionError(f"{tag}: still refused admission")


def _counted(store: BlockStore) -> list:
    """The keys the policy's passes look at, from now on."""
    visits: list = []
    inner = store._protected

    def protected(key: tuple) -> bool:
        visits.append(key)
        return inner(key)

    store._protected = protected
    return visits


def _full_of_leased(
    policy: str, kept: int = 0
) -> tuple[BlockStore, Namespace, LeaseTable, Lease]:
    """A pool whose every block is leased but for `kept` slots left free."""
    store = BlockStore(SlabAllocator(1 << 30, SLABS * SLAB, SLAB), POLICIES[policy]())
    ns = Namespace("ns", 1, 1, 1, SLOT, (1, SLOT))
    assert _save(store, ns, "old", RESIDENT - kept) == RESIDENT - kept
    held = [store.entries[(ns.id, _h("old", i))] for i in range(RESIDENT - kept)]
    leases = LeaseTable(store, ttl_s=60)
    return store, ns, leases, leases.create("i", ns.id, held, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_second_save_into_a_leased_pool_passes_over_none(policy: str) -> None:
    """The first save's pass over the leased pool finds nothing; the second,
    with nothing published or unpinned since, does not look again (before:
    the same pass, ~0.7 s of the event loop at 1,000,000 blocks, every save)."""
    store, ns, _, _ = _full_of_leased(policy)
    visits = _counted(store)
    assert _save(store, ns, "a", 8) == 0
    assert len(visits) >= RESIDENT  # the pass that found none
    visits.clear()
    assert _save(store, ns, "b", 8) == 0
    # TinyLFU's admitter looks for its first victim once a request: among
    # the blocks not parked (before parking: every leased block, each save)
    assert len(visits) == 0
    assert store.counters.pool_full_rejections == 16


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_a_save_after_an_unpin_passes_over_no_leased_block_again(policy: str) -> None:
    """The first pass parks the leased blocks it passes over: blocks unpinned
    later are the next save's victims without another pass over the leases
    (before: each unpin re-armed a pass over every leased block, ~0.7 s of
    the event loop at 1,000,000 blocks)."""
    store, ns, leases, whole = _full_of_leased(policy)
    held = whole.entries
    old, new = (
        leases.create("i", ns.id, held[:-8], 1),
        leases.create("i", ns.id, held[-8:], 1),
    )  # the newest 8 blocks: a pass reaches them last
    leases.release(whole.id)
    assert _save(store, ns, "a", 8) == 0
    visits = _counted(store)
    leases.release(new.id)
    assert _save_admitted(store, ns, "b", 8) == 8
    assert len(visits) <= 8 * 8  # up to 8 asks (TinyLFU), 8 keys each
    assert all(e.key not in store.entries for e in new.entries)
    assert all(e.key in store.entries for e in old.entries)
    assert len(store.policy) == RESIDENT
    leases.release(old.id)  # unparked: evictable again
    assert _save_admitted(store, ns, "c", 16) == 16


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_unpinned_after_the_pass_are_the_next_saves_victims(
    policy: str,
) -> None:
    store, ns, leases, lease = _full_of_leased(policy)
    assert _save(store, ns, "a", 8) == 0
    full = store.counters.pool_full_rejections
    leases.release(lease.id)
    assert _save_admitted(store, ns, "b", 8) == 8
    assert store.counters.evictions == 8
    assert store.counters.pool_full_rejections == full


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", [1, 3], ids=["one", "several"])
def test_blocks_published_after_the_pass_are_the_next_saves_victims(
    policy: str, n: int
) -> None:
    """A save reserved before the pool filled lands after the pass came back
    short: its blocks, unpinned once published, can go (one block and several
    are published by different paths)."""
    store, ns, _, _ = _full_of_leased(policy, kept=n)
    landing = _reserve(store, ns, "landing", n)
    assert len(landing.keys) == n
    assert _save(store, ns, "a", 8) == 0  # only leased and landing blocks
    store.finish_save(landing, True)
    full = store.counters.pool_full_rejections
    assert _save_admitted(store, ns, "b", n) == n
    assert store.counters.pool_full_rejections == full
    assert all((ns.id, _h("landing", i)) not in store.entries for i in range(n))
