"""A save of one slot class into a pool whose slabs all hold another: a slab's
worth of blocks goes in LRU order, then the emptiest slab with no pinned block
(pegaflow.cache.slab_victims), not most of the pool."""

from __future__ import annotations

import random

import numpy as np

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.leases import LeaseTable
from pegaflow.cache.prefix_eviction import PrefixLRUPolicy
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.keys import Namespace

SLAB = 256 << 10
A_SLOT, B_SLOT = 16 << 10, 32 << 10  # 16 A slots a slab, 8 B slots
PER_SLAB = SLAB // A_SLOT


def _ns(ident: int, slot: int) -> Namespace:
    return Namespace(f"ns{ident}", ident, 1, 2, slot, (2, slot // 2))


def _h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _save(store: BlockStore, ns: Namespace, hs: list[bytes]) -> np.ndarray:
    res = store.reserve_save(ns, 0, hs, np.arange(ns.num_layers))
    store.finish_save(res, True)
    return res.slots


def _slab(store: BlockStore, ns: Namespace, i: int) -> int:
    addr = store.entries[(ns.id, _h(i))].slots[0]
    return (addr - store.slabs.base) // SLAB


def _touch(store: BlockStore, ns: Namespace, order: list[int]) -> None:
    """Recency: order[0] least recently used, order[-1] most."""
    for i in order:
        assert len(store.longest_prefix(ns, [_h(i)])) == 1
    store.apply_touches()


def test_a_save_of_another_class_evicts_about_a_slab_not_the_pool() -> None:
    """16 slabs of A blocks touched in a shuffled order: the old code evicted
    217 of 256 for one B block. Bytes live in a real buffer: every A block
    left still holds its own, and leased blocks stay."""
    slabs = 16
    mem = np.zeros(slabs * SLAB, np.uint8)
    for policy in (LRUPolicy(), PrefixLRUPolicy()):
        mem[:] = 0
        store = BlockStore(SlabAllocator(mem.ctypes.data, mem.size, SLAB), policy)
        a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
        n = slabs * PER_SLAB
        for start in range(0, n, PER_SLAB):
            hs = [_h(i) for i in range(start, start + PER_SLAB)]
            for i, addr in enumerate(_save(store, a, hs).tolist(), start):
                off = addr - mem.ctypes.data
                mem[off : off + A_SLOT] = i % 251 + 1  # the block's bytes
        order = list(range(n))
        random.Random(0).shuffle(order)  # fixed: the same recency every run
        _touch(store, a, order)
        leases = LeaseTable(store, ttl_s=60)
        leased = order[:8]  # among the least recently used
        leases.create("i", a.id, [store.entries[(a.id, _h(i))] for i in leased], 1)

        (addr,) = _save(store, b, [b"b" * 32]).tolist()
        off = addr - mem.ctypes.data
        mem[off : off + B_SLOT] = 255  # the B block lands in its slot

        evicted = store.counters.evictions
        assert 0 < evicted <= 2 * PER_SLAB - 1, (type(policy).__name__, evicted)
        left = [i for i in range(n) if (a.id, _h(i)) in store.entries]
        assert len(left) == n - evicted
        assert set(leased) <= set(left)
        for i in left:
            assert len(store.longest_prefix(a, [_h(i)])) == 1
            addr = store.entries[(a.id, _h(i))].slots[0]
            off = addr - mem.ctypes.data
            assert (mem[off : off + A_SLOT] == i % 251 + 1).all(), i
        assert len(store.longest_prefix(b, [b"b" * 32])) == 1
        used = len(left) * A_SLOT + B_SLOT
        assert store.slabs.used_bytes == used


def test_the_emptiest_slab_with_a_leased_block_is_skipped() -> None:
    """4 slabs of A blocks; LRU order takes 10 of the first slab's and 2 of
    each other's: the first slab is then the emptiest, but a block of it is
    leased, so the next slab (fewest blocks, then lowest number) is emptied."""
    store = BlockStore(SlabAllocator(1 << 30, 4 * SLAB, SLAB), LRUPolicy())
    a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
    for start in range(0, 4 * PER_SLAB, PER_SLAB):
        _save(store, a, [_h(i) for i in range(start, start + PER_SLAB)])
    slab_of = {i: _slab(store, a, i) for i in range(4 * PER_SLAB)}
    by_slab = [
        [i for i in slab_of if slab_of[i] == s] for s in sorted(set(slab_of.values()))
    ]
    first = by_slab[0]
    swept = first[:10] + [i for blocks in by_slab[1:] for i in blocks[:2]]
    rest = [i for i in slab_of if i not in swept]
    _touch(store, a, swept + rest)
    leases = LeaseTable(store, ttl_s=60)
    leases.create("i", a.id, [store.entries[(a.id, _h(first[10]))]], 1)

    assert len(_save(store, b, [b"b" * 32])) == 1

    gone = {i for i in slab_of if (a.id, _h(i)) not in store.entries}
    assert gone == set(swept) | set(by_slab[1])
    assert store.counters.evictions == PER_SLAB + (PER_SLAB - 2)


def test_no_slab_free_of_pins_refuses_the_save() -> None:
    """Every slab holds a leased block: after the slab's worth in LRU order
    the save is refused, as in a pool full of pinned blocks; nothing more goes."""
    store = BlockStore(SlabAllocator(1 << 30, 4 * SLAB, SLAB), LRUPolicy())
    a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
    for start in range(0, 4 * PER_SLAB, PER_SLAB):
        _save(store, a, [_h(i) for i in range(start, start + PER_SLAB)])
    leases = LeaseTable(store, ttl_s=60)
    pinned = [store.entries[(a.id, _h(i))] for i in range(0, 4 * PER_SLAB, PER_SLAB)]
    leases.create("i", a.id, pinned, 1)
    _touch(store, a, [i for j in range(PER_SLAB) for i in range(j, 64, PER_SLAB)])

    assert len(_save(store, b, [b"b" * 32])) == 0
    assert store.counters.pool_full_rejections == 1
    assert store.counters.evictions == PER_SLAB
    assert all(e.key in store.entries for e in pinned)
    assert store.slabs.used_bytes == (4 * PER_SLAB - PER_SLAB) * A_SLOT


def test_slabs_of_unchecked_blocks_go_after_the_swept_slabs_worth() -> None:
    """Two slabs of a restart's unchecked A blocks, two of ready ones with a
    leased block each: after a slab's worth of ready blocks in LRU order (not
    all 30 evictable, as before), no slab of ready blocks qualifies, so a slab
    of unchecked ones goes whole (the emptiest, then the lower: slab 2, the
    first adopted); not a refusal."""
    store = BlockStore(SlabAllocator(1 << 30, 4 * SLAB, SLAB), LRUPolicy())
    a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
    addrs = [(1 << 30) + 2 * SLAB + i * A_SLOT for i in range(2 * PER_SLAB)]
    assert all(store.slabs.claim(addrs, A_SLOT))
    late = [_h(1000 + i) for i in range(2 * PER_SLAB)]
    store.adopt(a, late, np.array(addrs, np.uint64).reshape(-1, 1), unchecked=True)
    n = 2 * PER_SLAB
    for start in range(0, n, PER_SLAB):
        _save(store, a, [_h(i) for i in range(start, start + PER_SLAB)])
    leases = LeaseTable(store, ttl_s=60)
    leases.create("i", a.id, [store.entries[(a.id, _h(i))] for i in (0, 16)], 1)
    _touch(store, a, [i for j in range(PER_SLAB) for i in (j, j + PER_SLAB)])

    assert len(_save(store, b, [b"b" * 32])) == 1

    ready_gone = [i for i in range(n) if (a.id, _h(i)) not in store.entries]
    assert len(ready_gone) == PER_SLAB
    assert [h for h in late if (a.id, h) not in store.entries] == late[:PER_SLAB]
    assert store.counters.evictions == 2 * PER_SLAB


def test_unchecked_blocks_of_another_class_go_a_slab_at_a_time() -> None:
    """A restart's pool of 4 slabs of unchecked A blocks, adopted round-robin
    across the slabs (the last adopted go first): one B block evicted them one
    at a time until a slab emptied, 60 of 64. Now the emptiest slab whose
    blocks only their check pins goes whole: slab 0 holds one a query's check
    is reading, so slab 1's 16 go, no more."""
    store = BlockStore(SlabAllocator(1 << 30, 4 * SLAB, SLAB), LRUPolicy())
    a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
    addrs = [
        (1 << 30) + slab * SLAB + i * A_SLOT
        for i in range(PER_SLAB)
        for slab in range(4)
    ]
    assert all(store.slabs.claim(addrs, A_SLOT))
    hs = [_h(i) for i in range(4 * PER_SLAB)]
    rows = np.array(addrs, np.uint64).reshape(-1, 1)
    store.adopt(a, hs, rows, unchecked=True)
    read = store.entries[(a.id, hs[4])]  # in slab 0
    store.pin([read])  # a query's check reads it

    assert len(_save(store, b, [b"b" * 32])) == 1

    gone = [i for i in range(4 * PER_SLAB) if (a.id, hs[i]) not in store.entries]
    assert gone == list(range(1, 4 * PER_SLAB, 4))  # slab 1's, all of them
    assert store.counters.evictions == PER_SLAB
    assert len(store.unchecked) == 3 * PER_SLAB


def test_own_blocks_go_when_no_slab_of_another_class_can() -> None:
    """3 slabs of A blocks, each with a leased one, then a slab of B blocks
    used since: a save of 2 B blocks sweeps a slab's worth of A in LRU order
    (no slab empties) and finds no A slab free of pins. It was refused
    although B's own least recently used blocks could go; now those 2 go.
    A B save with a slab to empty still empties it (the earlier tests): an
    own block behind the sweep is not preferred to a foreign slab, as each
    later save would then pay a slab's worth of sweep for one slot."""
    store = BlockStore(SlabAllocator(1 << 30, 4 * SLAB, SLAB), LRUPolicy())
    a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
    for start in range(0, 3 * PER_SLAB, PER_SLAB):
        _save(store, a, [_h(i) for i in range(start, start + PER_SLAB)])
    ids = list(range(1000, 1000 + SLAB // B_SLOT))
    bs = [_h(i) for i in ids]
    _save(store, b, bs)
    leases = LeaseTable(store, ttl_s=60)
    pinned = [store.entries[(a.id, _h(i))] for i in range(0, 48, PER_SLAB)]
    leases.create("i", a.id, pinned, 1)
    _touch(store, a, [i for j in range(PER_SLAB) for i in range(j, 48, PER_SLAB)])
    _touch(store, b, ids)  # B's used after every A block

    assert len(_save(store, b, [b"new" * 8, b"new2" * 8])) == 2

    assert store.counters.pool_full_rejections == 0
    assert [h for h in bs if (b.id, h) not in store.entries] == bs[:2]
    assert store.counters.evictions == PER_SLAB + 2  # the sweep, then B's two
    assert all(e.key in store.entries for e in pinned)


def test_a_slab_of_another_class_goes_before_own_blocks_behind_the_sweep() -> None:
    """As above with no lease: after the sweep of a slab's worth of A (6, 5
    and 5 of its 3 slabs), the emptiest A slab goes (10 more), not B's own
    2 least recently used: its slots serve B's next saves too."""
    store = BlockStore(SlabAllocator(1 << 30, 4 * SLAB, SLAB), LRUPolicy())
    a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
    for start in range(0, 3 * PER_SLAB, PER_SLAB):
        _save(store, a, [_h(i) for i in range(start, start + PER_SLAB)])
    ids = list(range(1000, 1000 + SLAB // B_SLOT))
    _save(store, b, [_h(i) for i in ids])
    order = [i for j in range(PER_SLAB) for i in range(j, 48, PER_SLAB)]
    _touch(store, a, order)
    _touch(store, b, ids)

    assert len(_save(store, b, [b"new" * 8, b"new2" * 8])) == 2

    gone = {i for i in range(48) if (a.id, _h(i)) not in store.entries}
    assert gone == set(order[:PER_SLAB]) | set(range(PER_SLAB))
    assert all((b.id, _h(i)) in store.entries for i in ids)
    assert store.counters.evictions == PER_SLAB + 10


def test_a_slab_of_unchecked_and_ready_blocks_goes_whole() -> None:
    """Slab 0 holds 8 unchecked A blocks and 8 ready ones, slab 1 16 ready
    ones, one leased. The sweep takes slab 1's 15 and one of slab 0's; then
    slab 0's 15 left, unchecked and ready, go together for one B block."""
    store = BlockStore(SlabAllocator(1 << 30, 2 * SLAB, SLAB), LRUPolicy())
    a, b = _ns(1, A_SLOT), _ns(2, B_SLOT)
    addrs = [(1 << 30) + i * A_SLOT for i in range(0, PER_SLAB, 2)]
    assert all(store.slabs.claim(addrs, A_SLOT))
    late = [_h(500 + i) for i in range(len(addrs))]
    store.adopt(a, late, np.array(addrs, np.uint64).reshape(-1, 1), unchecked=True)
    _save(store, a, [_h(i) for i in range(PER_SLAB + 8)])  # slab 0's holes first
    _touch(store, a, list(range(8, 24)) + list(range(8)))
    leases = LeaseTable(store, ttl_s=60)
    leases.create("i", a.id, [store.entries[(a.id, _h(23))]], 1)

    assert len(_save(store, b, [b"b" * 32])) == 1

    assert [k for k in store.entries if k[0] == a.id] == [(a.id, _h(23))]
    assert not store.unchecked
    assert store.counters.evictions == 2 * PER_SLAB - 1


def test_a_save_into_a_pool_of_leased_blocks_passes_over_them_once() -> None:
    """61 of 64 resident blocks leased, the 3 others the most recent: a save
    of 32 stores 3, passing over the pool's blocks in LRU order once. The
    policy answered None when fewer than asked could go, the store asked again
    for half as many, and again after each eviction: 934 visits here, ~1 s of
    the event loop a save with a million blocks resident."""
    for policy in (LRUPolicy(), PrefixLRUPolicy()):
        store = BlockStore(SlabAllocator(1 << 30, 4 * SLAB, SLAB), policy)
        a = _ns(1, A_SLOT)
        resident = 4 * PER_SLAB
        _save(store, a, [_h(i) for i in range(resident)])
        leases = LeaseTable(store, ttl_s=60)
        held = [store.entries[(a.id, _h(i))] for i in range(resident - 3)]
        leases.create("i", a.id, held, 1)
        visits: list[tuple] = []

        def counted(key: tuple, seen: list = visits, inner=store._protected) -> bool:
            seen.append(key)
            return inner(key)

        store._protected = counted

        got = store.reserve_save(a, 0, [b"n" * 31 + bytes([i]) for i in range(32)],
                                 np.arange(a.num_layers))  # fmt: skip
        store.finish_save(got, True)

        assert len(got.keys) == 3 and store.counters.evictions == 3
        # one pass, and the admission's look at the first victim
        assert len(visits) <= resident + 4, f"{len(visits)} visits of {resident}"
