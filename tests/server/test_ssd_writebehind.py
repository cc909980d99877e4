"""Write-behind to the SSD tier (--ssd-write-on seal) through a real server: a
sealed block is written while it is still in L1, a full write queue drops and
counts without touching saves, and evicting a block already on the SSD frees
its slots at once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc
from tests.server.test_ssd_tier import BLOCK, _flags, _load_and_check, _until_ready


def _written(server: ServerProc, n: int, timeout: float = 20.0) -> None:
    """Poll until n blocks are on the SSD with nothing left in the queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = server.metric("pegaflow_ssd_written_blocks_total")
        if done >= n and server.metric("pegaflow_ssd_queue_depth") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{done} of {n} blocks written to the SSD")


def test_sealed_blocks_reach_ssd_without_eviction_and_survive_sigkill(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: 64 blocks are saved into a pool that holds 256, so none is
    evicted. With --ssd-write-on seal they are on the SSD soon after the save
    all the same; the server is SIGKILLed and restarted on the same SSD files,
    and all 64 come back as hits, byte for byte (with evict they would be lost:
    blocks reached the SSD only when L1 evicted them)."""
    flags = _flags(tmp_path, "--ssd-write-on", "seal")
    server = server_factory(*flags)
    kv = LocalKV(seed=11)
    first = hashes(64)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        want = [kv.block(i).copy() for i in range(64)]
        assert client.save("e", list(range(64)), first).stored == 64
        _written(server, 64)
        assert server.metric("pegaflow_evictions_total") == 0
        assert server.metric("pegaflow_resident_blocks") == 64  # still in L1
        assert server.metric("pegaflow_ssd_blocks") == 64
    server.stop(signal.SIGKILL)
    server = server_factory(*flags)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        assert client.query("e", first).loading
        res = _until_ready(client, "e", first)
        assert res.num_blocks == 64
        _load_and_check(client, kv, "e", res, want)


def test_full_write_queue_drops_and_counts_and_saves_all_land(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: one save seals 64 blocks at once behind a write queue of one
    block: most writes are dropped, each counted once (queued + dropped = 64),
    and the save stores all 64 in L1 regardless, every one a byte-equal hit."""
    server = server_factory(
        *_flags(tmp_path, "--ssd-write-on", "seal", "--ssd-queue-blocks", "1")
    )
    kv = LocalKV(seed=12)
    hs = hashes(64)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        want = [kv.block(i).copy() for i in range(64)]
        assert client.save("e", list(range(64)), hs).stored == 64
        queued = server.metric("pegaflow_ssd_spills_queued_total")
        dropped = server.metric("pegaflow_ssd_spills_dropped_total")
        assert dropped > 0 and queued + dropped == 64
        res = client.query("e", hs)
        assert res.num_blocks == 64 and not res.loading
        _load_and_check(client, kv, "e", res, want)


def test_evicting_a_block_already_on_ssd_frees_its_slots_at_once(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: bursts of 64 new blocks (each fits the write queue) are saved
    into a full pool, each written behind before the next burst, so every
    victim of an eviction is already on the SSD. After every burst the
    allocated pool bytes are exactly the resident blocks' (no slot held for a
    spill), each block was queued once, at its seal (none at its eviction), and
    the first 64, long evicted, load from the SSD byte for byte."""
    server = server_factory(*_flags(tmp_path, "--ssd-write-on", "seal"))
    kv = LocalKV(seed=13)
    first = hashes(64)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        want = [kv.block(i).copy() for i in range(64)]
        stored = client.save("e", list(range(64)), first).stored
        _written(server, stored)
        pool = int(server.metric("pegaflow_pool_capacity_bytes")) // BLOCK
        for _ in range(2 * pool // 64):
            res = client.save("e", list(range(64)), hashes(64))
            assert res.stored + res.rejected == 64
            stored += res.stored
            used = server.metric("pegaflow_pool_used_bytes")
            assert used == server.metric("pegaflow_resident_blocks") * BLOCK
            _written(server, stored)
        assert server.metric("pegaflow_evictions_total") >= pool
        assert server.metric("pegaflow_ssd_spills_queued_total") == stored
        assert server.metric("pegaflow_ssd_spills_dropped_total") == 0
        res = _until_ready(client, "e", first)
        assert res.num_blocks == 64
        _load_and_check(client, kv, "e", res, want)
