"""Prefix-aware eviction (--eviction prefix) through a real server and client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes

# 4 MiB pool: 16 slabs of 256 KiB; 4 layers x 4 KiB pages = 16 KiB blocks
POOL = ("--pool-size", "4mb")
ROOT = Path(__file__).resolve().parents[2]
EVICT = 16


def _capacity(kv: LocalKV) -> int:
    """Slots in the pool for kv's blocks (see pegaflow.cache.slabs.SlabAllocator)."""
    skew = kv.buf.ctypes.data % 4096
    return 16 * (((256 << 10) - skew) // (16 << 10))


def _chain_then_fill(server, seed: int) -> tuple[PegaflowClient, list[bytes], int]:
    """A 64-block chain that arrives as vLLM sends it -- its first half saved,
    then a query of all of it (32 hit: its lease released), then the second
    half saved -- then other blocks until exactly EVICT blocks must go."""
    kv = LocalKV(layers=4, blocks=64, page=4096, seed=seed)
    client = PegaflowClient(server.addr, timeout_s=10)
    kv.register(client, "e", "ns")
    chain = hashes(64)
    assert client.save("e", list(range(32)), chain[:32]).stored == 32
    hit = client.query("e", chain)
    assert hit.num_blocks == 32
    client.release_lease(hit.lease_id)
    assert client.save("e", list(range(32)), chain[32:]).stored == 32
    filler = hashes(_capacity(kv) - 64 + EVICT)
    for i in range(0, len(filler), 64):
        part = filler[i : i + 64]
        assert client.save("e", list(range(len(part))), part).stored == len(part)
    assert server.metric("pegaflow_evictions_total") == EVICT
    return client, chain, len(filler)


def _resident(client: PegaflowClient, hs: list[bytes]) -> list[int]:
    """1 where the block alone hits (each lease released at once)."""
    out = []
    for h in hs:
        hit = client.query("e", [h])
        out.append(hit.num_blocks)
        if hit.num_blocks:
            client.release_lease(hit.lease_id)
    return out


def test_prefix_eviction_takes_chain_tails_first(server_factory) -> None:
    """The chain's head is the least recent (LRU order: touched by the query
    before its tail was saved). LRU evicts the head, and the chain's query then
    hits nothing though 48 of its blocks stay; prefix-aware eviction takes the
    last 16 blocks, tail first, and the query hits the 48 before them."""
    lru = server_factory(*POOL)
    client, chain, _ = _chain_then_fill(lru, seed=1)
    with client:
        assert _resident(client, chain) == [0] * EVICT + [1] * (64 - EVICT)
        assert client.query("e", chain).num_blocks == 0
    lru.stop()

    prefix = server_factory(*POOL, "--eviction", "prefix")
    client, chain, filler = _chain_then_fill(prefix, seed=1)
    with client:
        hit = client.query("e", chain)
        assert hit.num_blocks == 64 - EVICT
        client.release_lease(hit.lease_id)
        assert _resident(client, chain) == [1] * (64 - EVICT) + [0] * EVICT


def test_unknown_eviction_policy_is_refused_at_start() -> None:
    """Scenario: a policy name the server does not know stops the start with
    exit 2, naming the flag and its choices."""
    proc = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "--pool-size", "4mb"]
        + ["--eviction", "lfu"],
        capture_output=True,
        cwd=ROOT,
        timeout=60,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "--eviction" in err and "'lru', 'prefix'" in err
