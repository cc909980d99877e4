"""The owner's pin table (pegaflow.tiers.remote.pins) against a peer that holds the
cluster token but lies: a request repeating one ready hash pins it once, and
a pin id (random, not a counter) is the asking host's alone: another host's
Checksums and Release find nothing."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
import xxhash

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.pool import HostPool
from pegaflow.common.keys import Namespace, PackedHashes, namespace_digest
from pegaflow.common.settings import PoolConfig
from pegaflow.tiers.remote.peer_service import caller_host
from pegaflow.tiers.remote.pins import PinTable
from pegaflow.tiers.remote.slot_sums import SlotHasher

SLOT = 16 << 10
NS = Namespace("m", 1, 1, 2, SLOT, (2, SLOT // 2, SLOT // 2))
READER, OTHER = "ipv4:10.0.0.5", "ipv4:10.0.0.6"


@pytest.fixture
def table():
    pool = HostPool(PoolConfig(4 << 20, prefault_threads=1, show_progress=False))
    store = BlockStore(pool.slabs, LRUPolicy())
    hashes = [bytes([i]) * 32 for i in range(4)]
    res = store.reserve_save(NS, 0, hashes, np.arange(2))
    rng = np.random.default_rng(2)
    for slot in res.slots.tolist():
        pool.view(slot, SLOT)[:] = rng.integers(0, 256, SLOT, np.uint8)
    store.finish_save(res, True)
    hasher = SlotHasher(1)
    yield PinTable(store, pool, hasher), store, pool, hashes
    hasher.close()
    pool.close()


def _packed(hashes: list[bytes]) -> PackedHashes:
    return PackedHashes(b"".join(hashes), 32, len(hashes))


def test_a_repeated_hash_is_pinned_once(table) -> None:
    pins, store, _, hashes = table

    async def go():
        return await pins.pin(NS, _packed([hashes[0]] * 1000 + hashes[1:]), 5, READER)

    got = asyncio.run(go())
    assert got.pin_id and len(got.slots) == 1
    assert pins._pinned_bytes == SLOT
    assert store.entries[(1, hashes[0])].pins == 1


def test_a_pin_is_the_asking_hosts_alone(table) -> None:
    pins, store, pool, hashes = table

    async def go():
        a = await pins.pin(NS, _packed(hashes), 5, READER)
        b = await pins.pin(NS, _packed(hashes[:1]), 5, READER)
        assert abs(a.pin_id - b.pin_id) > 1 << 20  # not a counter (2^-43 to fail)
        assert await pins.checksums(a.pin_id, OTHER) is None
        assert not pins.release(a.pin_id, OTHER)
        assert store.entries[(1, hashes[0])].pins == 2  # still pinned
        sums = await pins.checksums(a.pin_id, READER)
        raw = [xxhash.xxh3_64_intdigest(pool.view(int(s), SLOT)) for s in
               a.slots.ravel()]  # fmt: skip
        # bound to each block's key (slot_sums.bound): digest, hash, shard, raw
        digest = namespace_digest(NS.name, NS.signature)
        want = [
            xxhash.xxh3_64_intdigest(digest + h + struct.pack("<IQ", 0, r))
            for h, r in zip(hashes, raw, strict=True)
        ]
        assert sums.ravel().tolist() == want
        assert pins.release(a.pin_id, READER) and pins.release(b.pin_id, READER)
        assert not pins.release(a.pin_id, READER)  # once

    asyncio.run(go())
    assert store.entries[(1, hashes[0])].pins == 0 and len(pins) == 0


@pytest.mark.parametrize(
    "peer, host",
    [
        ("ipv4:10.0.0.5:43210", "ipv4:10.0.0.5"),
        ("ipv6:[fe80::1]:5000", "ipv6:[fe80::1]"),
        ("unix:/run/pegaflow.sock", "unix:/run/pegaflow.sock"),
    ],
)
def test_caller_host_drops_the_port(peer: str, host: str) -> None:
    assert caller_host(peer) == host
