"""Every way a remote fetch can go wrong ends as a miss (counted by cause),
never a hang and never a wrong byte loaded."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from pegaflow.common.peer_auth import METADATA_KEY
from pegaflow.proto import peer_pb2 as pb
from pegaflow.proto import peer_pb2_grpc as pb_grpc
from tests.remote.conftest import (
    BIG,
    SHAPE,
    SHAPE_BLOCK_BYTES,
    TOKEN,
    Cluster,
    block_hashes,
    indexed,
    namespace_digest,
)

pytestmark = pytest.mark.timeout(300)


def _owner(cluster: Cluster, node: int, instance: str, n: int, shape=SHAPE):
    engine = cluster.engine(node, instance, seed=11 + node, namespace="big"
                            if shape is BIG else "m", shape=shape)  # fmt: skip
    ids = list(range(n))
    hashes = block_hashes(instance, n)
    assert engine.call("save", block_ids=ids, hashes=hashes)["stored"] == n
    return engine, ids, hashes


BIG_BLOCK_BYTES = 8 * 32768  # what a block holds


def _failed(cluster: Cluster, node: int) -> dict[str, int]:
    return cluster.remote(node)["failed_blocks"]


def test_peer_killed_mid_transfer_is_a_miss(cluster: Cluster) -> None:
    """Scenario: node 2 holds a 32 MiB prefix and sends at 200 Mbit/s (a read
    of it takes ~1.3 s); node 1 starts fetching it and node 2 is SIGKILLed
    mid-read: node 1's query ends as a miss within the fetch deadline, no
    block of it is published, and the next query is answered at once."""
    _, _, hashes = _owner(cluster, 2, "kill-a", 128, BIG)
    indexed(cluster, 2, hashes, BIG_BLOCK_BYTES)
    reader = cluster.engine(1, "kill-b", 5, namespace="big", shape=BIG)
    cluster.nodes[2].limit_rate("200mbit")
    try:
        result: dict = {}
        started = time.monotonic()
        thread = threading.Thread(
            target=lambda: result.update(reader.call("query", hashes=hashes, wait_s=30))
        )
        thread.start()
        cluster.wait_remote(1, lambda r: r["loading_blocks"] > 0, "the fetch",
                            timeout_s=10)  # fmt: skip
        time.sleep(0.3)  # past the pin (a small RPC): inside the 1.3 s read
        cluster.servers[2].stop(signal.SIGKILL)
        thread.join(40)
    finally:
        cluster.nodes[2].limit_rate(None)
    took = time.monotonic() - started
    assert not thread.is_alive(), "the query hung"
    assert result["num_blocks"] == 0 and not result["loading"], result
    assert took < 5 + 5, took  # --remote-fetch-timeout 5, and a margin
    failed = _failed(cluster, 1)
    assert failed["transport"] + failed["deadline"] >= 128, failed
    again = time.monotonic()
    assert reader.call("query", hashes=hashes, wait_s=10)["num_blocks"] == 0
    assert time.monotonic() - again < 6
    # The failed read's slots were kept from reuse (its bytes might still
    # land), then given back once --remote-quarantine (3 s) had passed.
    assert cluster.remote(1)["quarantined_slots"] >= 128
    cluster.wait_remote(1, lambda r: r["quarantined_bytes"] == 0, "the quarantine",
                        timeout_s=10)  # fmt: skip
    cluster.start_server(2)  # a new incarnation for the tests after this one
    cluster.wait_remote(2, lambda r: r["joined"], "node 2 joining again")


def test_stopped_peer_is_a_miss_at_the_deadline(cluster: Cluster) -> None:
    """Scenario: node 2 holds a prefix and stops answering (SIGSTOP): node 1's
    pin waits at most --remote-fetch-timeout (5 s), then the query is a miss;
    node 2, continued, serves again."""
    _, _, hashes = _owner(cluster, 2, "stop-a", 8)
    indexed(cluster, 2, hashes, SHAPE_BLOCK_BYTES)
    reader = cluster.engine(1, "stop-b", 9)
    was = _failed(cluster, 1)
    server = cluster.servers[2]
    server.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        got = reader.call("query", hashes=hashes, wait_s=20)
        took = time.monotonic() - started
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert got["num_blocks"] == 0 and not got["loading"], got
    assert 4.0 < took < 5 + 3, took  # the deadline, not a hang
    now = _failed(cluster, 1)
    late = sum(now[c] - was[c] for c in ("peer_unreachable", "deadline"))
    assert late >= 8, now
    cluster.wait_remote(2, lambda r: r["joined"], "node 2 serving again")


def test_peer_evicted_meanwhile_is_a_miss(cluster: Cluster) -> None:
    """Scenario: node 0 advertised a prefix, then lost its way to the
    metaserver (a blackhole route) and evicted the prefix: the metaserver still
    names node 0, node 1's pin finds nothing there, and the query is a miss
    counted as peer_evicted."""
    node = cluster.nodes[0]
    owner, ids, hashes = _owner(cluster, 0, "evict-a", 64, BIG)
    indexed(cluster, 0, hashes, BIG_BLOCK_BYTES)
    # ready before the route goes: node 0 is dropped as stale 6 s after it
    reader = cluster.engine(1, "evict-b", 6, namespace="big", shape=BIG)
    route = ["ip", "route", "add", "blackhole", f"{cluster.meta_node.address}/32"]
    subprocess.run(node.argv(*route), check=True)
    try:
        # 256 MiB pool of 256 KiB blocks: 1024 new ones evict the prefix
        for start in range(0, 1024, 256):
            fresh = block_hashes(f"evict-fill{start}", 256)
            owner.call("save", block_ids=list(range(256)), hashes=fresh)
        was = _failed(cluster, 1)["peer_evicted"]
        got = reader.call("query", hashes=hashes, wait_s=10)
        assert got["num_blocks"] == 0 and not got["loading"], got
        assert _failed(cluster, 1)["peer_evicted"] >= was + 1
    finally:
        subprocess.run(node.argv("ip", "route", "del", "blackhole",
                                 f"{cluster.meta_node.address}/32"))  # fmt: skip


def test_lying_peer_bytes_never_loaded(cluster: Cluster) -> None:
    """Scenario: node 0's pool bytes change after it computed their checksums
    (a peer serving other bytes than it vouched for): node 1 reads them, finds
    every block failing its checksum, loads none, and counts them."""
    _, _, hashes = _owner(cluster, 0, "liar-a", 16)
    indexed(cluster, 0, hashes, SHAPE_BLOCK_BYTES)
    digest = namespace_digest(cluster, 0, SHAPE_BLOCK_BYTES)
    raw = b"".join(bytes.fromhex(h) for h in hashes)
    with grpc.insecure_channel(cluster.servers[0].addr) as channel:
        stub = pb_grpc.PeerStub(channel)
        pin = stub.Pin(
            pb.PinRequest(namespace=digest, hash_len=len(raw) // 16, hashes=raw,
                          hold_ms=5000, slot_bytes=SHAPE_BLOCK_BYTES, shards=1),
            timeout=10, metadata=((METADATA_KEY, TOKEN),),
        )  # fmt: skip
        assert pin.blocks == 16
        # what node 0 vouches for: computed now, from the bytes it holds
        sums = stub.Checksums(pb.ChecksumsRequest(pin_id=pin.pin_id), timeout=10,
                              metadata=((METADATA_KEY, TOKEN),))  # fmt: skip
        assert len(sums.checksums) == 16 * 8
        slots = np.frombuffer(pin.slot_addrs, "<u8")
        with open(f"/proc/{cluster.servers[0].pid}/mem", "r+b", buffering=0) as mem:
            for addr in slots.tolist():  # the peer's bytes change under it
                mem.seek(addr)
                mem.write(np.random.default_rng(addr).bytes(SHAPE_BLOCK_BYTES))
        stub.Release(pb.ReleaseRequest(pin_id=pin.pin_id), timeout=5,
                     metadata=((METADATA_KEY, TOKEN),))  # fmt: skip
    reader = cluster.engine(1, "liar-b", 7)
    was = _failed(cluster, 1)["checksum"]
    got = reader.call("query", hashes=hashes, wait_s=10)
    assert got["num_blocks"] == 0, got
    assert _failed(cluster, 1)["checksum"] == was + 16


def test_metaserver_restart_index_whole_again(cluster: Cluster) -> None:
    """Scenario: the metaserver is SIGKILLed: a query that misses locally is a
    miss at once, counted as `metaserver`. It is restarted empty: within one
    heartbeat period (2 s here) each node rejoins and re-sends what it holds,
    and a prefix saved before the restart is a remote hit again."""
    _, ids, hashes = _owner(cluster, 0, "meta-a", 8)
    indexed(cluster, 0, hashes, SHAPE_BLOCK_BYTES)
    rejoins = cluster.remote(0).get("rejoins", 0)
    cluster.meta.stop(signal.SIGKILL)
    # while it is down: a miss, at once (no hang), counted against it
    reader = cluster.engine(2, "meta-b", 8)
    was = _failed(cluster, 2)["metaserver"]
    asked = time.monotonic()
    got = reader.call("query", hashes=hashes, wait_s=10)
    assert got["num_blocks"] == 0 and not got["loading"], got
    assert time.monotonic() - asked < 2.0
    assert _failed(cluster, 2)["metaserver"] == was + len(hashes)
    cluster.start_metaserver()
    serving = time.monotonic()  # from READY: not the process's own start
    cluster.wait_remote(0, lambda r: r["rejoins"] > rejoins, "rejoining", 10)
    took = time.monotonic() - serving
    # One heartbeat, and the rejoin itself (the channel reconnects within a
    # second: pegaflow.common.channels).
    assert took < 2.0 + 2.0, took
    time.sleep(2.1)  # the miss above is remembered for 2 s
    got = reader.call("query", hashes=hashes, wait_s=10)
    assert got["num_blocks"] == 8, got
