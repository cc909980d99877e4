"""BlockStore bookkeeping without copies: visibility, dedup, pins, eviction order."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.cache import ready_index
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import AdmissionPolicy, LRUPolicy, TinyLFU
from pegaflow.cache.leases import LeaseTable
from pegaflow.cache.ready_index import DICT_BELOW
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.keys import Namespace, PackedHashes

SLOT = 4096


def _ns(tp: int = 1, layers: int = 2, ident: int = 1) -> Namespace:
    return Namespace(f"ns{ident}", ident, tp, layers, SLOT, (layers, SLOT))


def _store(slots: int, policy: object | None = None) -> BlockStore:
    return BlockStore(
        SlabAllocator(1 << 30, slots * SLOT, SLOT),
        policy if policy is not None else LRUPolicy(),
    )


def _save(
    store: BlockStore,
    ns: Namespace,
    hashes: list[bytes],
    rank: int = 0,
    layers: np.ndarray | None = None,
    ok: bool = True,
) -> tuple[int, int, int]:
    layers = np.arange(ns.num_layers) if layers is None else layers
    res = store.reserve_save(ns, rank, hashes, layers)
    store.finish_save(res, ok)
    return len(res.keys), res.deduplicated, res.rejected


def _h(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in ids]


def test_prefix_stops_at_first_miss_and_dedups() -> None:
    store, ns = _store(16), _ns()
    assert _save(store, ns, _h(1, 2, 3)) == (3, 0, 0)
    assert _save(store, ns, _h(1, 2, 3, 3)) == (0, 4, 0)
    assert len(store.longest_prefix(ns, _h(1, 2, 9, 3))) == 2
    assert store.slabs.used_bytes == 3 * SLOT


def test_block_visible_only_when_all_layers_and_shards_landed() -> None:
    store, ns = _store(16), _ns(tp=2, layers=2)
    _save(store, ns, _h(1), rank=0)
    assert store.longest_prefix(ns, _h(1)) == []  # shard 1 missing
    _save(store, ns, _h(1), rank=1, layers=np.array([0]))
    assert store.longest_prefix(ns, _h(1)) == []  # layer 1 of shard 1 missing
    _save(store, ns, _h(1), rank=1, layers=np.array([1]))
    assert len(store.longest_prefix(ns, _h(1))) == 1
    assert store.slabs.used_bytes == 2 * SLOT


def test_failed_copy_frees_the_slot() -> None:
    store, ns = _store(4), _ns()
    _save(store, ns, _h(1, 2), ok=False)
    assert store.slabs.used_bytes == 0 and not store.entries


def test_lru_eviction_skips_leased_blocks_and_accounting_returns() -> None:
    store, ns = _store(4), _ns()
    leases = LeaseTable(store, ttl_s=60)
    _save(store, ns, _h(1, 2, 3, 4))
    lease = leases.create("i", ns.id, store.longest_prefix(ns, _h(1)), 1)  # pin 1
    store.longest_prefix(ns, _h(2))  # touch 2: now LRU order is 3, 4, 1(pinned), 2
    _save(store, ns, _h(5, 6))
    assert set(k[1] for k in store.entries) == set(_h(1, 2, 5, 6))
    assert store.counters.evictions == 2
    _save(store, ns, _h(7, 8, 9))  # only 2 evictable (2, 5 ... order 2,5,6)
    assert (1, _h(1)[0]) in store.entries  # the leased block survived everything
    leases.consumed(lease, 0)
    assert len(leases) == 0 and all(e.pins == 0 for e in store.entries.values())
    assert store.slabs.used_bytes == len(store.entries) * SLOT == 4 * SLOT


def test_pool_full_of_pinned_blocks_rejects() -> None:
    store, ns = _store(2), _ns()
    leases = LeaseTable(store, ttl_s=60)
    _save(store, ns, _h(1, 2))
    leases.create("i", ns.id, store.longest_prefix(ns, _h(1, 2)), 1)
    assert _save(store, ns, _h(3)) == (0, 0, 1)
    assert store.counters.pool_full_rejections == 1
    assert store.slabs.used_bytes == 2 * SLOT  # nothing leaked by the rejection


def test_expired_leases_are_swept() -> None:
    store, ns = _store(4), _ns()
    leases = LeaseTable(store, ttl_s=5)
    _save(store, ns, _h(1))
    lease = leases.create("i", ns.id, store.longest_prefix(ns, _h(1)), 2)
    assert leases.sweep(now=lease.expires - 1) == 0
    assert leases.sweep(now=lease.expires) == 1
    assert store.entries[(1, _h(1)[0])].pins == 0


def test_stale_partial_blocks_dropped() -> None:
    store, ns = _store(4), _ns(tp=2)
    _save(store, ns, _h(1), rank=0)
    entry = store.entries[(1, _h(1)[0])]
    assert store.drop_stale(older_than=entry.created - 1) == 0
    assert store.drop_stale(older_than=entry.created + 1) == 1
    assert store.slabs.used_bytes == 0


class _NoFullScans(dict):
    """The store's index, refusing a pass over every entry."""

    def _refused(self, *args: object) -> None:
        raise AssertionError("a pass over every entry of the store")

    items = values = keys = __iter__ = _refused


def test_the_sweep_looks_only_at_blocks_not_published() -> None:
    """The sweep runs every second: it used to pass over every entry (45 ms a
    second with 1,000,000 resident blocks, the event loop's, each time). It
    reads the entries made unready since and forgets those published or gone
    meanwhile; a stale one still goes, a tier read's or a save's."""
    store, ns = _store(64), _ns(tp=2)
    _save(store, ns, _h(*range(10, 40)), rank=0)  # published below: both ranks
    _save(store, ns, _h(*range(10, 40)), rank=1)
    _save(store, ns, _h(1), rank=0)  # rank 1 never comes
    (read,) = store.reserve_load(ns, _h(2))
    store.unpin([read])  # its tier read gave up without a word (pinned until then)
    store.entries = _NoFullScans(store.entries)
    created = max(store.entries[(1, h)].created for h in _h(1, 2))
    assert store.drop_stale(older_than=created + 1) == 2
    assert (1, _h(1)[0]) not in store.entries and (1, _h(2)[0]) not in store.entries
    assert len(store.longest_prefix(ns, _h(*range(10, 40)))) == 30
    assert store.unready == {}  # the published ones forgotten too


def test_the_sweep_passes_over_no_block_a_restart_still_checks() -> None:
    """A warm restart's recovered blocks wait, unchecked and pinned by their
    check, for minutes on a big pool: the sweep can never drop them, and
    used to read every one of them each second (1,000,000 after a restart);
    the check's verdict makes them ready or drops them."""
    store, ns = _store(64), _ns()
    base = store.slabs.base
    addrs = [base + i * SLOT for i in range(40)]
    assert all(store.slabs.claim(addrs, SLOT))
    hashes = _h(*range(100, 140))
    fresh = store.adopt(ns, hashes, np.array(addrs, np.uint64).reshape(-1, 1), True)
    assert len(fresh) == 40 and store.unready == {}
    store.entries = _NoFullScans(store.entries)
    assert store.drop_stale(older_than=time.monotonic() + 3600) == 0
    ok = np.arange(40) % 2 == 0  # half pass their check
    store.finish_load(fresh, ok)
    assert len(store.longest_prefix(ns, hashes[:1])) == 1
    assert sum((1, h) in store.entries for h in hashes) == 20


def test_tinylfu_keeps_hot_set_through_a_scan() -> None:
    """LRU loses the hot set to a scan of one-time blocks; TinyLFU keeps it."""

    def run(policy: object) -> int:
        store, ns = _store(32, policy), _ns()
        hot = _h(*range(16))
        for _ in range(5):
            for h in hot:
                if not store.longest_prefix(ns, [h]):
                    _save(store, ns, [h])
        for i in range(1000, 1200):  # a scan: each block seen once
            if not store.longest_prefix(ns, _h(i)):
                _save(store, ns, _h(i))
        return sum(bool(store.longest_prefix(ns, [h])) for h in hot)

    assert run(LRUPolicy()) == 0
    assert run(AdmissionPolicy(LRUPolicy(), TinyLFU(64))) == 16


def test_repeats_in_one_request_count_once_for_admission() -> None:
    """TinyLFU counts how often a block is seen: a save naming one block 60
    times was admitted after 50 rejections inside that one request, and a
    query naming a cached block 65,536 times recorded each copy, aging every
    other block's count to nothing. A repeat in one request is seen once."""
    store, ns = _store(16, AdmissionPolicy(LRUPolicy(), TinyLFU(64))), _ns()
    hot = _h(*range(16))
    for _ in range(5):  # a hot set, seen five times each
        for h in hot:
            if not store.longest_prefix(ns, [h]):
                _save(store, ns, [h])
    stored, _, rejected = _save(store, ns, _h(999) * 60)
    assert stored == 0 and rejected == 60
    found, rest = store.lookup(ns, _h(3) * 65536)  # one block, repeated: one hit
    assert len(found) == 1 and len(rest) == 65535 and not rest[0] and rest[1:].all()
    store.apply_touches()
    assert sum(bool(store.longest_prefix(ns, [h])) for h in hot) == 16
    stored, _, _ = _save(store, ns, _h(998))  # the sketch still says who is hot
    assert stored == 0


@pytest.mark.parametrize("tp", [1, 4])
def test_namespaces_are_isolated(tp: int) -> None:
    store = _store(16)
    a, b = _ns(tp=tp, ident=1), _ns(tp=tp, ident=2)
    for rank in range(tp):
        _save(store, a, _h(1, 2), rank=rank)
    assert len(store.longest_prefix(a, _h(1, 2))) == 2
    assert store.longest_prefix(b, _h(1, 2)) == []


def test_a_save_bigger_than_the_free_room_evicts_just_enough_in_lru_order() -> None:
    store, ns = _store(8), _ns()
    _save(store, ns, _h(*range(1, 9)))
    store.longest_prefix(ns, _h(1))  # LRU order now 2..8, 1
    assert _save(store, ns, _h(10, 11, 11, 12)) == (3, 1, 0)  # 11 twice: dedup
    assert store.counters.evictions == 3
    assert set(k[1] for k in store.entries) == set(_h(1, *range(5, 9), 10, 11, 12))
    # Larger than the pool: the first 8 get slots, the other 2 are refused.
    assert _save(store, ns, _h(*range(20, 30))) == (8, 0, 2)
    assert store.counters.pool_full_rejections == 2
    assert store.slabs.used_bytes == len(store.entries) * SLOT == 8 * SLOT


def test_a_save_overlapping_layers_in_flight_leaves_them_to_the_first() -> None:
    """Save A copies layer 0 of a block; save B of layers 0-1 arrives
    meanwhile and fails: B must not have shared A's in-flight layer (clearing
    it on failure would free the slot A still writes, and hand it to another
    block); A lands, a later save of layer 1 completes the block in A's slot."""
    store, ns = _store(4), _ns(layers=2)
    first = store.reserve_save(ns, 0, _h(1), np.array([0]))
    slot = int(first.slots[0])
    second = store.reserve_save(ns, 0, _h(1), np.array([0, 1]))
    assert len(second.keys) == 0 and second.deduplicated == 1
    store.finish_save(second, False)
    other = store.reserve_save(ns, 0, _h(2, 3, 4), np.arange(2))
    assert slot not in other.slots.tolist()  # never handed to another block
    store.finish_save(other, True)
    store.finish_save(first, True)
    assert _save(store, ns, _h(1), layers=np.array([1])) == (1, 0, 0)
    entry = store.entries[(1, _h(1)[0])]
    assert entry.ready and entry.slots == [slot]


def test_saves_of_disjoint_layers_share_a_block_and_one_may_fail() -> None:
    store, ns = _store(4), _ns(layers=2)
    first = store.reserve_save(ns, 0, _h(1), np.array([0]))
    second = store.reserve_save(ns, 0, _h(1), np.array([1]))
    assert len(second.keys) == 1 and int(second.slots[0]) == int(first.slots[0])
    store.finish_save(second, False)  # layer 0 still in flight: the slot stays
    assert store.slabs.used_bytes == SLOT
    store.finish_save(first, True)
    assert _save(store, ns, _h(1), layers=np.array([1])) == (1, 0, 0)
    assert store.entries[(1, _h(1)[0])].ready


def test_slow_tier_reservation_takes_whole_blocks_only() -> None:
    """TP=2: a block needs two slots; with three free, one block is reserved
    and the odd slot goes back."""
    store, ns = _store(3), _ns(tp=2)
    got = store.reserve_load(ns, _h(1, 2, 3))
    assert [e.key[1] for e in got] == _h(1) and store.slabs.used_bytes == 2 * SLOT
    assert (1, _h(2)[0]) not in store.entries
    store.finish_load(got, np.array([True]))
    assert len(store.longest_prefix(ns, _h(1, 2))) == 1
    assert _save(store, ns, _h(1), rank=1) == (0, 1, 0)  # ready: dedup


def test_withheld_slots_of_a_failed_load_are_not_reused_until_freed() -> None:
    """A slow-tier load whose read may still write its slots: the blocks that
    did not arrive leave the index, but the slots of the withheld ones stay out
    of the allocator (saves evict or are refused instead) until free_withheld."""
    store, ns = _store(2), _ns(tp=1)
    got = store.reserve_load(ns, _h(1, 2))
    held = store.finish_load(got, np.array([False, True]), np.array([True, False]))
    assert held.tolist() == got[0].slots
    assert (1, _h(1)[0]) not in store.entries  # not loaded, not findable
    assert store.slabs.used_bytes == 2 * SLOT
    for h in (9, 10):  # each evicts the one ready block, never the held slot
        assert _save(store, ns, _h(h)) == (1, 0, 0)
        assert store.entries[(1, _h(h)[0])].slots != got[0].slots
    assert store.counters.evictions == 2
    store.free_withheld(held)
    assert _save(store, ns, _h(11)) == (1, 0, 0)
    assert store.entries[(1, _h(11)[0])].slots == got[0].slots  # free: no eviction
    assert store.counters.evictions == 2


def test_large_packed_queries_take_the_hash_table_through_evictions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fast-path query of DICT_BELOW+ hashes probes the numpy table (here
    from the first block on): hits up to the first miss, the ready blocks
    behind it flagged, evicted blocks gone from it, and a list query of the
    same hashes agrees."""
    monkeypatch.setattr(ready_index, "TABLE_ABOVE", 0)
    n = DICT_BELOW + 200
    store, ns = _store(n), _ns(layers=1)
    rng = np.random.default_rng(3)
    hs = [rng.bytes(32) for _ in range(n)]
    _save(store, ns, hs)
    packed = PackedHashes.pack(hs, 32)
    hits, rest = store.lookup(ns, packed)
    assert [e.key[1] for e in hits] == hs and len(rest) == 0
    store.longest_prefix(ns, hs[100:])  # LRU order now 0..99, then the rest
    _save(store, ns, [rng.bytes(32) for _ in range(10)])  # evicts 0..9
    for query in (PackedHashes.pack(hs, 32), hs):
        hits, rest = store.lookup(ns, query)
        assert hits == [] and rest.tolist() == [False] * 10 + [True] * (n - 10)
        hits, rest = store.lookup(ns, hs[10:])
        assert len(hits) == n - 10 and len(rest) == 0


def test_each_admitted_block_faces_the_victim_it_displaces() -> None:
    """Seven warm blocks against a full pool whose LRU end is one cold block
    and then six hot ones: each was compared with the cold one, all seven
    got in, and the six hot blocks behind it were evicted. Now each admitted
    block displaces the next victim, which the next candidate then faces."""
    policy = AdmissionPolicy(LRUPolicy(), TinyLFU(64))
    store, ns = _store(8, policy), _ns()
    cold, hot, spare = _h(100), _h(*range(1, 7)), _h(200)
    for h in cold + hot + spare:  # LRU order: cold, hot 1..6, spare
        _save(store, ns, [h])
    sketch = policy._sketch
    for h in hot + spare:
        for _ in range(6):
            sketch.record((ns.id, h))
    warm = _h(*range(10, 17))
    for h in warm:
        for _ in range(3):
            sketch.record((ns.id, h))
    stored, _, rejected = _save(store, ns, warm)
    assert (stored, rejected) == (1, 6)  # one displaced the cold block
    assert all(store.longest_prefix(ns, [h]) for h in hot + spare)
    assert not store.longest_prefix(ns, cold)
