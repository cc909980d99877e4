"""The batched bookkeeping of the save path does what its per-item loop did:
slab frees, ready-index adds and removes, LRU inserts."""

from __future__ import annotations

import numpy as np

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.ready_index import ReadyIndex
from pegaflow.cache.slabs import SlabAllocator


def _state(a: SlabAllocator) -> tuple:
    partial = {c: list(d) for c, d in a._partial.items()}
    for slab, free in a._free_slots.items():  # the numpy counts agree
        assert a.used[slab] == a.slots_per_slab(a._slab_class[slab]) - len(free)
    assert (a.class_no >= 0).sum() == len(a._slab_class)
    assert not a.used[a.class_no < 0].any()
    state = a.free_slabs, a._free_slots, partial, a._slab_class, a.used_bytes
    return (*state, a.used.tolist())


def test_a_batched_free_leaves_the_allocator_as_the_loop_does() -> None:
    """Random frees of two slot classes, some emptying whole slabs."""
    rng = np.random.default_rng(0)
    loop, batch = (SlabAllocator(1 << 20, 64 << 16, 1 << 16) for _ in range(2))
    held = np.zeros(0, np.uint64)
    for _ in range(40):
        cls = ((4096, 0), (12288, 512))[int(rng.integers(2))]
        n = int(rng.integers(1, 60))
        got = [a.allocate(cls, n) for a in (loop, batch)]
        assert np.array_equal(*got)
        held = rng.permutation(np.concatenate([held, got[0]]))
        cut = int(rng.integers(0, len(held) + 1))
        out, held = held[:cut], held[cut:]
        for addr in out.tolist():
            loop.free(np.array([addr], np.uint64))
        batch.free(out)
        assert _state(loop) == _state(batch)
    assert loop.free_slabs  # some slabs emptied and went back


def test_ready_index_add_many_and_remove_many_match_add_and_remove() -> None:
    one, many = ReadyIndex(), ReadyIndex()
    keys = [(1, bytes([i % 256, i // 256]) * 16) for i in range(3000)]
    a = [BlockEntry(k, [1]) for k in keys]
    b = [BlockEntry(k, [1]) for k in keys]
    for e in a[:2000]:
        one.add(e)
    many.add_many(b[:2000])
    one.prefix_listed([k[1] for k in keys[:10]])  # nothing flushed by this
    for e in a[500:1500]:
        one.remove(e)
    many.remove_many(b[500:1500])
    for e in a[2000:]:
        one.add(e)
    many.add_many(b[2000:])
    assert [e.row for e in a] == [e.row for e in b]
    assert len(one) == len(many) == 2000
    from pegaflow.common.keys import PackedHashes

    q = PackedHashes.pack([k[1] for k in keys], 32)
    for index in (one, many):  # both through the hash table now
        found, rest = index.probe(q)
        assert len(found) == 500 and rest[1000:].all() and not rest[:1000].any()


def test_lru_insert_many_orders_as_insert() -> None:
    one, many = LRUPolicy(), LRUPolicy()
    for k in (1, 2, 3):
        one.insert(k)
        many.insert(k)
    for k in (4, 2, 5, 4):
        one.insert(k)
    many.insert_many([4, 2, 5, 4])
    assert list(one._order) == list(many._order) == [1, 3, 2, 5, 4]
    never = lambda key: False  # noqa: E731
    assert one.evict(5, never) == many.evict(5, never)
