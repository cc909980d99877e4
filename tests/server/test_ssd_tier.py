"""The L3 SSD tier through a real server: spill on L1 eviction, `loading` then
`ready`, restart on the same files, damage on disk, a full spill queue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.results import QueryResult
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, ServerProc, _env, start_server

BLOCK = 4 * 4096  # LocalKV(layers=4, page=4096): one block's bytes
HASH_IN_HEADER = 28  # pegaflow.gds.format._HEADER: magic, version, ids, digest


def _flags(tmp: Path, *extra: str) -> tuple[str, ...]:
    return (
        "--pool-size",
        "4mb",
        "--ssd-cache-path",
        str(tmp / "ssd0.bin"),
        "--ssd-cache-capacity",
        "32mb",
        "--ssd-backend",
        "posix",
        *extra,
    )


def _fill(client: PegaflowClient, kv: LocalKV, inst: str) -> list[bytes]:
    """64 blocks of fresh random bytes, then the pool's worth of others on top:
    the 64 are evicted (spilled). Returns their hashes; kv keeps their bytes in
    blocks 0..63 of a copy returned by _snapshot."""
    first = hashes(64)
    assert client.save(inst, list(range(64)), first).stored == 64
    kv.randomize(list(range(64)), seed=99)
    for _ in range(5):  # 5 x 64 x 16 KiB > the 4 MiB pool
        client.save(inst, list(range(64)), hashes(64))
    return first


def _wait_flushed(server: ServerProc, timeout: float = 10.0) -> None:
    """Every queued spill is on disk (or refused), and its slots are back."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = server.metric("pegaflow_ssd_spills_queued_total")
        done = sum(
            server.metric(f"pegaflow_ssd_{n}_total")
            for n in ("written_blocks", "no_space", "write_errors")
        )
        resident = server.metric("pegaflow_resident_blocks")
        used = server.metric("pegaflow_pool_used_bytes")
        if queued == done and used == resident * BLOCK:
            return
        time.sleep(0.05)
    raise AssertionError("spills not flushed")


def _until_ready(client: PegaflowClient, inst: str, hs: list[bytes]) -> QueryResult:
    deadline = time.monotonic() + 10
    while (res := client.query(inst, hs)).loading and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not res.loading
    return res


def _load_and_check(
    client: PegaflowClient, kv: LocalKV, inst: str, res: QueryResult, want: list
) -> None:
    dst = list(range(63, 63 - len(want), -1))  # other block ids than saved
    kv.randomize(dst, seed=7)
    client.load(inst, res.lease_id, dst)
    for i, b in enumerate(dst):
        assert np.array_equal(kv.block(b), want[i]), f"block {i}"


def test_spill_then_loading_then_ready_from_another_client(
    server_factory, tmp_path: Path
) -> None:
    server = server_factory(*_flags(tmp_path))
    kv, kv2 = LocalKV(seed=1), LocalKV(seed=2)
    with PegaflowClient(server.addr, 10) as a, PegaflowClient(server.addr, 10) as b:
        kv.register(a, "a", "ns")
        want = [kv.block(i).copy() for i in range(64)]
        first = _fill(a, kv, "a")
        _wait_flushed(server)
        assert server.metric("pegaflow_ssd_blocks") >= 64
        kv2.register(b, "b", "ns")  # another engine of the namespace
        got = b.query("b", first)  # over the unix socket: it starts the load
        assert b._socket.connected
        assert got.loading and got.num_blocks == 64 and got.lease_id == 0
        res = _until_ready(b, "b", first)
        assert res.num_blocks == 64
        _load_and_check(b, kv2, "b", res, want)
        assert server.metric("pegaflow_ssd_load_blocks_total") == 64  # one load
        assert server.metric("pegaflow_ssd_read_bytes_total") == 64 * BLOCK
        assert server.metric("pegaflow_ssd_hit_blocks_total") == 64
        assert server.metric("pegaflow_ssd_prefetch_seconds_count") == 1
        stats = json.loads(server.get("/stats")[1])
        assert stats["tiers"]["ssd"] == {"enabled": True, "hit_blocks": 64}
        health = json.loads(server.get("/health")[1])
        assert health["ssd_mode"].startswith("posix")
        assert health["ssd_capacity_bytes"] == 32 << 20
        assert 'pegaflow_ssd_info{mode="posix' in server.get("/metrics")[1].decode()


def test_kill9_restart_hits_spilled_blocks(server_factory, tmp_path: Path) -> None:
    server = server_factory(*_flags(tmp_path))
    kv = LocalKV(seed=3)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        want = [kv.block(i).copy() for i in range(64)]
        first = _fill(client, kv, "e")
        _wait_flushed(server)
    server.stop(signal.SIGKILL)
    server = server_factory(*_flags(tmp_path))
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        with PegaflowClient(server.addr, 10) as grpc_only:  # never registers
            got = grpc_only.query("e", first)
        assert got.loading and got.num_blocks == 64 and got.lease_id == 0
        res = _until_ready(client, "e", first)
        assert res.num_blocks == 64
        _load_and_check(client, kv, "e", res, want)


def _flip_payload(path: Path, block_hash: bytes) -> None:
    data = path.read_bytes()
    at = data.find(block_hash)
    assert at > 0 and data.find(block_hash, at + 1) < 0
    record = at - HASH_IN_HEADER
    assert record % 4096 == 0
    fd = os.open(path, os.O_RDWR)
    try:
        pos = record + 4096 + 1234  # HEADER_BYTES, then the payload
        byte = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), pos)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_flipped_bytes_on_disk_are_a_counted_miss(
    server_factory, tmp_path: Path
) -> None:
    server = server_factory(*_flags(tmp_path))
    kv = LocalKV(seed=4)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        want = [kv.block(i).copy() for i in range(64)]
        first = _fill(client, kv, "e")
        _wait_flushed(server)
        _flip_payload(tmp_path / "ssd0.bin", first[3])
        assert client.query("e", first).loading
        res = _until_ready(client, "e", first)
        assert res.num_blocks == 3  # stops at the damaged block: a miss
        assert server.metric("pegaflow_ssd_checksum_failures_total") == 1
        client.release_lease(res.lease_id)
        # the engine recomputes block 3 and saves it again: all 64 hit
        kv.views[0][5], kv.views[1][5] = want[3][:4096], want[3][4096:8192]
        kv.views[2][5], kv.views[3][5] = want[3][8192:12288], want[3][12288:]
        assert client.save("e", [5], [first[3]]).stored == 1
        res = client.query("e", first)
        assert res.num_blocks == 64 and not res.loading
        _load_and_check(client, kv, "e", res, want)


def test_full_spill_queue_drops_without_touching_l1(
    server_factory, tmp_path: Path
) -> None:
    server = server_factory(*_flags(tmp_path, "--ssd-queue-blocks", "1"))
    kv = LocalKV(seed=5)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "e", "ns")
        _fill(client, kv, "e")
        _wait_flushed(server)  # also: every slot is back or still a block's
        assert server.metric("pegaflow_ssd_spills_dropped_total") > 0
        last = hashes(64)
        want = [kv.block(i).copy() for i in range(64)]
        assert client.save("e", list(range(64)), last).stored == 64
        res = client.query("e", last)
        assert res.num_blocks == 64 and not res.loading
        _load_and_check(client, kv, "e", res, want)


def test_ssd_flag_errors_are_clear(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pegaflow.cli", "--no-http", *args],
            env=_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    res = cli("--ssd-cache-path", str(tmp_path / "x"))
    assert res.returncode == 2 and "--ssd-cache-capacity" in res.stderr
    res = cli(*_flags(tmp_path / "missing-dir")[2:], "--pool-size", "1mb")
    assert res.returncode == 2 and "missing-dir" in res.stderr, res.stderr
    # A direct SSD -> GPU route asked of a server with no GPU to copy to.
    res = cli(*_flags(tmp_path, "--ssd-gpu-direct", "on"))
    assert res.returncode == 2, res.stderr
    assert "--ssd-gpu-direct on: this server copies to no GPU" in res.stderr


def test_start_server_with_ssd_reports_mode(tmp_path: Path) -> None:
    server = start_server(tmp_path, *_flags(tmp_path, "--ssd-direct-io", "off"))
    try:
        health = json.loads(server.get("/health")[1])
        assert health["ssd_mode"] == "posix-buffered"
        assert health["ssd_gpu_route"] == "l1"
        assert health["ssd_gpu_route_reason"] == "no CUDA devices"
    finally:
        assert server.stop() == 0
