"""Eviction, admission, leases, isolation and visibility through a real server."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import LeaseNotFound
from tests.kvbuf import LocalKV, hashes

# 4 MiB pool: 16 slabs of 256 KiB; 4 layers x 4 KiB pages = 16 KiB blocks
POOL = ("--pool-size", "4mb")
SLOTS = 256  # about: fewer when the slots take the engine pages' 4 KiB offset


def _capacity(kv: LocalKV) -> int:
    """Slots in the pool for kv's blocks (see pegaflow.cache.slabs.SlabAllocator)."""
    skew = kv.buf.ctypes.data % 4096
    return 16 * (((256 << 10) - skew) // (16 << 10))


def _client(server) -> PegaflowClient:
    return PegaflowClient(server.addr, timeout_s=10)


def _save_all(client: PegaflowClient, kv: LocalKV, inst: str, hs: list[bytes]) -> int:
    stored = 0
    for i in range(0, len(hs), kv.blocks):
        chunk = hs[i : i + kv.blocks]
        stored += client.save(inst, list(range(len(chunk))), chunk).stored
    return stored


def test_eviction_keeps_leased_blocks_lru_order_and_accounting(server_factory) -> None:
    server = server_factory(*POOL)
    kv = LocalKV(layers=4, blocks=64, page=4096, seed=1)
    with _client(server) as client:
        kv.register(client, "e", "ns")
        first = hashes(64)
        assert client.save("e", list(range(64)), first).stored == 64
        leased = client.query("e", first[:8])  # pins the first 8 blocks
        assert leased.num_blocks == 8
        client.query("e", first[8:16])  # touch: 8..15 become most recent
        client.release_lease(client.query("e", first[8:16]).lease_id)
        # fill the pool and 48 blocks beyond: exactly 48 evictions are needed
        later = hashes(_capacity(kv) - 64 + 48)
        assert _save_all(client, kv, "e", later) == len(later)
        assert server.metric("pegaflow_evictions_total") == 48
        # leased 0..7 survived; LRU evicted untouched 16..63, kept touched 8..15
        assert client.query("e", first[:8]).num_blocks == 8
        survivors = [client.query("e", [h]).num_blocks for h in first[8:]]
        assert survivors == [1] * 8 + [0] * 48
        # one more round past the pool: still nothing leased is evicted
        _save_all(client, kv, "e", hashes(SLOTS))
        assert client.query("e", first[:8]).num_blocks == 8
        # bytes of the surviving leased blocks are still the ones saved
        dst = list(range(32, 40))
        kv.randomize(dst, seed=5)
        client.load("e", leased.lease_id, dst)
        for i, b in enumerate(dst):
            assert np.array_equal(kv.block(b), kv.block(i))
        # unregistering drops the instance's leases: nothing stays pinned, and the
        # used bytes are exactly the resident blocks' slots
        assert server.metric("pegaflow_active_leases") > 0
        client.unregister("e")
        assert server.metric("pegaflow_active_leases") == 0
        resident = server.metric("pegaflow_resident_blocks")
        assert (
            server.metric("pegaflow_pool_used_bytes") == resident * kv.layers * kv.page
        )


def test_tinylfu_scan_keeps_hot_set(server_factory) -> None:
    """Hot blocks hit repeatedly, then a scan of one-time blocks twice the pool:
    LRU loses the hot set, --enable-lfu-admission keeps it."""
    kept = {}
    for flags in ((), ("--enable-lfu-admission",)):
        server = server_factory(*POOL, *flags)
        kv = LocalKV(layers=4, blocks=64, page=4096, seed=2)
        with _client(server) as client:
            kv.register(client, "e", "ns")
            hot = hashes(64)
            client.save("e", list(range(64)), hot)
            for _ in range(4):
                for h in hot:
                    client.release_lease(client.query("e", [h]).lease_id)
            for _ in range(2 * SLOTS // 64):
                scan = hashes(64)
                assert client.query("e", scan).num_blocks == 0
                client.save("e", list(range(64)), scan)
            kept[flags] = sum(client.query("e", [h]).num_blocks for h in hot)
            rejected = server.metric("pegaflow_admission_rejections_total")
        server.stop()
    assert kept[()] == 0
    assert kept[("--enable-lfu-admission",)] == 64 and rejected > 0


def test_expired_leases_are_swept(server_factory) -> None:
    server = server_factory(*POOL, "--lease-ttl", "0.3")
    kv = LocalKV(seed=3)
    with _client(server) as client:
        kv.register(client, "e", "ns")
        hs = hashes(4)
        client.save("e", [0, 1, 2, 3], hs)
        lease = client.query("e", hs)
        assert server.metric("pegaflow_active_leases") == 1
        deadline = time.monotonic() + 5
        while server.metric("pegaflow_active_leases") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.metric("pegaflow_active_leases") == 0
        with pytest.raises(LeaseNotFound, match="lease_id"):
            client.load("e", lease.lease_id, [4, 5, 6, 7])


def test_namespaces_are_isolated(server) -> None:
    a, b = LocalKV(seed=4), LocalKV(seed=5)
    with _client(server) as client:
        a.register(client, "a", "model-A")
        b.register(client, "b", "model-B")
        hs = hashes(8)
        assert client.save("a", list(range(8)), hs).stored == 8
        assert client.query("b", hs).num_blocks == 0
        assert client.save("b", list(range(8)), hs).stored == 8  # its own copy
        lease = client.query("b", hs)
        client.load("b", lease.lease_id, list(range(10, 18)))
        for i in range(8):  # b got b's bytes, not a's
            assert np.array_equal(b.block(10 + i), b.block(i))
            assert not np.array_equal(b.block(10 + i), a.block(i))


def test_partial_tp_saves_stay_invisible(server) -> None:
    rank0, rank1 = LocalKV(seed=6), LocalKV(seed=7)
    with _client(server) as client:
        rank0.register(client, "tp", "ns-tp2", tp_rank=0, tp_size=2)
        rank1.register(client, "tp", "ns-tp2", tp_rank=1, tp_size=2)
        hs = hashes(4)
        client.save("tp", [0, 1, 2, 3], hs, tp_rank=0)
        assert client.query("tp", hs).num_blocks == 0
        client.save("tp", [0, 1], hs[:2], tp_rank=1)
        client.save("tp", [2], hs[2:3], tp_rank=1, layer_ids=[0, 1])
        assert client.query("tp", hs).num_blocks == 2  # block 2 lacks layers 2, 3
        client.save("tp", [2, 3], hs[2:], tp_rank=1)
        lease = client.query("tp", hs)
        assert lease.num_blocks == 4
        for rank, kv in enumerate((rank0, rank1)):
            client.load("tp", lease.lease_id, [20, 21, 22, 23], tp_rank=rank)
            for i in range(4):
                assert np.array_equal(kv.block(20 + i), kv.block(i))
        # world_size (2) workers loaded: the lease is consumed
        with pytest.raises(LeaseNotFound):
            client.release_lease(lease.lease_id)


def test_a_second_models_save_leaves_the_first_models_cache(server_factory) -> None:
    """Models of two block sizes share the pool. A's blocks fill it, used one
    from each slab in turn (recency interleaved across slabs); one save of B
    (a slab of its own size needed) evicts under two slabs' worth of A's, not
    nearly all (241 of 256 before: LRU order emptied no slab until the end);
    every A block left loads its own bytes."""
    server = server_factory(*POOL)
    a, b = LocalKV(seed=8), LocalKV(blocks=4, page=8192, seed=9)  # 16, 32 KiB
    again = LocalKV(blocks=SLOTS, seed=10)  # another worker of model A
    with _client(server) as client:
        a.register(client, "a", "model-A")
        b.register(client, "b", "model-B")
        again.register(client, "a2", "model-A")
        n = _capacity(a)
        per_slab = n // 16
        hs = hashes(n)
        assert _save_all(client, a, "a", hs) == n
        for j in range(per_slab):  # block j of every slab, then j + 1's
            touch = client.query("a", hs[j::per_slab])
            assert touch.num_blocks == 16
            client.release_lease(touch.lease_id)
        assert client.save("b", [0], hashes(1)).stored == 1

        evicted = server.metric("pegaflow_evictions_total")
        assert 0 < evicted <= 2 * (256 << 10) // (16 << 10)  # two slabs' bytes
        left = []
        for k in range(n):
            hit = client.query("a", [hs[k]])
            if hit.num_blocks:
                left.append(k)
                client.release_lease(hit.lease_id)
        assert len(left) == n - evicted
        lease = client.query("a2", [hs[k] for k in left])
        assert lease.num_blocks == len(left)
        client.load("a2", lease.lease_id, list(range(len(left))))
        for i, k in enumerate(left):
            assert np.array_equal(again.block(i), a.block(k % a.blocks))
