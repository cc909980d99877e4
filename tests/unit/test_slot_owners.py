"""The allocator's map of which block each slot holds (SlabAllocator.own),
which the slab-aware eviction reads (pegaflow.cache.slab_victims): after any
sequence of saves (failed ones too), evictions, saves of another slot class,
a restart's adopted and checked blocks, lower-tier loads and stale drops,
every live block's slots map to it and no free slot maps to anything. It was
a dict that kept the slots of failed saves and loads and grew ~40 B a slot."""

from __future__ import annotations

import random
import time

import numpy as np

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.prefix_eviction import PrefixLRUPolicy
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.keys import Namespace

BASE, SLAB, SLABS = 1 << 30, 64 << 10, 6
A_SLOT, B_SLOT = 4 << 10, 8 << 10  # 16 A slots a slab, 8 B slots


def _h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _consistent(store: BlockStore, withheld: list[np.ndarray]) -> None:
    slabs = store.slabs
    held: dict[int, BlockEntry] = {}
    for entry in store.entries.values():
        held.update((a, entry) for a in entry.slots if a)
    if held:
        owners = slabs.owners_at(np.array(list(held), np.uint64))
        assert all(map(lambda o, e: o is e, owners, held.values()))
    mapped = 0
    for slab in range(slabs.size_slabs):
        owners = slabs.owners(slab)
        if slabs.class_no[slab] < 0:
            assert owners is None, slab  # a free slab keeps no map
            continue
        in_use = sum(o is not None for o in owners.tolist())
        assert in_use == slabs.used[slab], slab  # free slots map to nothing
        mapped += in_use
    # Slots held by no live block: those a failed load withheld (a read may
    # still write them), mapped to their gone block until freed.
    assert mapped == len(held) + sum(map(len, withheld))


def test_the_slot_map_follows_every_save_eviction_load_and_restart() -> None:
    for policy in (LRUPolicy(), PrefixLRUPolicy()):
        rng = random.Random(7)  # fixed: the same sequence every run
        store = BlockStore(SlabAllocator(BASE, SLABS * SLAB, SLAB), policy)
        a = Namespace("a", 1, 1, 2, A_SLOT, (2, A_SLOT // 2))
        b = Namespace("b", 2, 2, 2, B_SLOT, (2, B_SLOT // 2))  # TP 2
        # A restart's pool: a slab of A blocks, half of them checked later.
        addrs = [BASE + 5 * SLAB + i * A_SLOT for i in range(SLAB // A_SLOT)]
        assert all(store.slabs.claim(addrs, A_SLOT))
        rows = np.array(addrs, np.uint64).reshape(-1, 1)
        late = store.adopt(a, [_h(900 + i) for i in range(len(addrs))], rows, True)
        withheld: list[np.ndarray] = []
        _consistent(store, withheld)
        store.finish_load(late[:8], np.array([True, False] * 4))
        _consistent(store, withheld)
        pinned: list[BlockEntry] = []
        for _ in range(400):
            op = rng.random()
            ns = a if rng.random() < 0.5 else b
            hs = [_h(rng.randrange(80)) for _ in range(rng.randint(1, 12))]
            if op < 0.55:  # a save of one shard, 1 in 10 failing
                rank = rng.randrange(ns.tp_size)
                res = store.reserve_save(ns, rank, hs, np.arange(2))
                store.finish_save(res, rng.random() < 0.9)
            elif op < 0.7:  # a lower tier's load, some lost, some withheld
                got = store.reserve_load(ns, [_h(100 + rng.randrange(80))])
                ok = np.array([rng.random() < 0.6 for _ in got], bool)
                hold = np.array([rng.random() < 0.5 for _ in got], bool)
                withheld.append(store.finish_load(got, ok, hold))
            elif op < 0.8:  # hits, and leases pinning some blocks
                store.longest_prefix(ns, hs)
                ready = [e for e in store.entries.values() if e.ready]
                if ready and len(pinned) < 6:
                    pinned.append(rng.choice(ready))
                    store.pin(pinned[-1:])
            elif op < 0.9:
                if pinned:
                    store.unpin([pinned.pop(0)])
                if withheld:
                    store.free_withheld(withheld.pop(0))
            else:  # shards that never came
                store.drop_stale(time.monotonic() + 1)
            _consistent(store, withheld)
        assert store.counters.evictions > 50  # the pool was full, often
        assert {e.key[0] for e in store.entries.values()} == {a.id, b.id}
