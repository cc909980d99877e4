"""A warm restart serves before it has checked the whole kept pool file, and
still never serves a block before that block's check (pegaflow.server.pool_check),
after a SIGTERM and after a SIGKILL alike: real servers, a kept pool at a path
in /dev/shm, a block damaged in it while no server ran."""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pegaflow.cache.pool_file import SEALED
from pegaflow.client.pegaflow_client import PegaflowClient
from tests.keeper_tools import mapped
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc
from tests.server.test_pool_file import (
    SHM,
    N,
    _data_offset,
    _flags,
    _health,
    _rows,
    _save,
    checked,
    settled,
)

# 1 KiB a second: the background pass needs 16 s a block of 16 KiB, ~17
# minutes for the file; a query's blocks are checked at once all the same.
SLOW = ("--pool-check-rate", "1kb", "--prefault-threads", "1")
BAD = 10


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """Pool files in /dev/shm, as tests/server/test_pool_file.py keeps them."""
    if not SHM.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="pegaflow-test-", dir=SHM) as d:
        yield Path(d)


def _all_sealed(path: Path, deadline_s: float = 60) -> None:
    """Wait until the live server's sealer has checksummed all N slots (the
    pool is shared: its rows are read as the server writes them)."""
    deadline = time.monotonic() + deadline_s
    with mapped(path) as m:
        while int((_rows(m)["state"] == SEALED).sum()) < N:
            assert time.monotonic() < deadline, "slots not sealed after 60 s"
            time.sleep(0.05)


def _damage(path: Path, h: bytes) -> None:
    """Flip one byte of the slot holding block `h`."""
    with mapped(path) as m:
        rows = _rows(m)
        sealed = np.flatnonzero(rows["state"] == SEALED).tolist()
        hs = [bytes(rows["hash"][i][: rows["hash_len"][i]]) for i in sealed]
        (row,) = [i for i, got in zip(sealed, hs, strict=True) if got == h]
        m[_data_offset(m) + int(rows["offset"][row]) + 999] ^= 0x01
        del rows


def _load(client: PegaflowClient, kv: LocalKV, hs: list[bytes]) -> list[np.ndarray]:
    """The blocks of a settled query's hits, loaded into block ids 0.."""
    res = settled(client, "b", hs)
    if not res.num_blocks:
        return []
    client.load("b", res.lease_id, list(range(res.num_blocks)))
    return [kv.block(i).copy() for i in range(res.num_blocks)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_restart_serves_before_its_check_ends_and_never_a_damaged_block(
    server_factory, tmp_path: Path, sig: int
) -> None:
    """Scenario: 64 blocks saved and sealed; the server stops (SIGTERM, or
    SIGKILL: the same rows either way, so the same work at the next start);
    one byte of block 10 is flipped in the file. The restarted server, its
    background check capped at 1 KiB/s, serves blocks 0-3 byte-equal while
    most of the file is still unchecked (it did not hash the pool before
    serving); block 10 is never served (a miss, counted as a bad checksum),
    the blocks after it hit byte-equal, and the whole check then ends with
    63 blocks kept."""
    path = tmp_path / "pool.bin"
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=11))
    _all_sealed(path)
    server.stop(sig)
    _damage(path, hs[BAD])

    server = server_factory(*_flags(tmp_path, *SLOW))
    report = _health(server)["pool_recovered"]
    assert (report["blocks"], report["torn"], report["unsealed"]) == (N, 0, 0)
    assert report["unchecked"] > 0
    kv = LocalKV(seed=12)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "b", "ns")
        got = _load(client, kv, hs[:4])
        assert len(got) == 4 and all(map(np.array_equal, got, want[:4]))
        assert _health(server)["pool_recovered"]["unchecked"] > 0
        assert settled(client, "b", [hs[BAD]]).num_blocks == 0  # never served
        assert _health(server)["pool_recovered"]["bad_checksum"] == 1
        got = _load(client, kv, hs[BAD + 1 :])
        assert len(got) == N - BAD - 1
        assert all(map(np.array_equal, got, want[BAD + 1 :]))
        got = _load(client, kv, hs[:BAD])  # the rest of the first ten
        assert len(got) == BAD and all(map(np.array_equal, got, want[:BAD]))
    report = checked(server)  # every block was asked for: the check is done
    assert (report["blocks"], report["bad_checksum"]) == (N - 1, 1)


def test_a_save_of_an_unchecked_block_is_deduplicated_and_served_once_checked(
    server_factory: ServerProc, tmp_path: Path
) -> None:
    """Scenario: after a restart (check capped), an engine saves block 20
    again before the check reached it: the save is acknowledged without a
    second slot, and the block is served from its recovered slot once a
    query had it checked, byte-equal."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=13))
    server.stop(signal.SIGTERM)
    server = server_factory(*_flags(tmp_path, *SLOW))
    used = server.metric("pegaflow_pool_used_bytes")
    kv = LocalKV(seed=14)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "b", "ns")
        assert client.save("b", [0], [hs[20]]).deduplicated == 1
        assert server.metric("pegaflow_pool_used_bytes") == used
        got = _load(client, kv, [hs[20]])
        assert len(got) == 1 and np.array_equal(got[0], want[20])


def test_a_save_of_an_unchecked_block_that_then_fails_its_check_is_stored(
    server_factory: ServerProc, tmp_path: Path
) -> None:
    """Scenario: block 20 is damaged in the kept pool while no server runs;
    after the restart (check capped) an engine saves block 20 before the
    check reached it. The save waits for that block's check (moved to the
    head of the queue), which fails: it copies its own bytes instead of
    answering "deduplicated" against a block about to be dropped (the
    engine's offer was once lost: acknowledged, then a miss), and block 20
    is then served with the engine's bytes."""
    path = tmp_path / "pool.bin"
    server = server_factory(*_flags(tmp_path))
    hs, _ = _save(server, LocalKV(seed=15))
    _all_sealed(path)
    server.stop(signal.SIGTERM)
    _damage(path, hs[20])
    server = server_factory(*_flags(tmp_path, *SLOW))
    kv = LocalKV(seed=16)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "b", "ns")
        res = client.save("b", [0], [hs[20]])
        assert (res.stored, res.deduplicated, res.rejected) == (1, 0, 0)
        assert _health(server)["pool_recovered"]["bad_checksum"] == 1
        mine = kv.block(0).copy()
        kv.randomize([0], seed=17)
        got = _load(client, kv, [hs[20]])
        assert len(got) == 1 and np.array_equal(got[0], mine)


def test_a_full_kept_pool_takes_saves_before_its_check_reached_its_blocks(
    server_factory: ServerProc, tmp_path: Path
) -> None:
    """Scenario: the kept pool is full (1,024 blocks of 16 KiB saved into
    16 MiB: the last ~1,000 kept) when the server restarts with its check
    capped at 1 KiB/s (~4.5 hours for the pool). A new save of 16 blocks is
    stored at once, evicting 16 recovered blocks not checked yet (they were
    never evictable: every save was refused `pool_full` until the check
    reached them); the check skips the evicted ones, and a recovered block
    still there is served byte-equal."""
    server = server_factory(*_flags(tmp_path))
    kv = LocalKV(seed=18)
    hs = hashes(1024, b"full")
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "a", "ns")
        for i in range(0, 1024, N):
            assert client.save("a", list(range(N)), hs[i : i + N]).stored == N
        kept = int(server.metric("pegaflow_resident_blocks"))
        assert kept < 1024  # the pool's worth: full (saves evicted)
    server.stop(signal.SIGTERM)

    server = server_factory(*_flags(tmp_path, *SLOW))
    before = _health(server)["pool_recovered"]
    assert before["blocks"] == kept and before["unchecked"] > kept - 16
    new = LocalKV(seed=19)
    with PegaflowClient(server.addr, 10) as client:
        new.register(client, "b", "ns")
        res = client.save("b", list(range(16)), hashes(16, b"new"))
        assert (res.stored, res.rejected) == (16, 0)
        after = _health(server)["pool_recovered"]
        assert after["unchecked"] <= before["unchecked"] - 16
        assert after["bad_checksum"] == 0
        # Evicted in slot order (rows say nothing of recency): block 500 sits
        # mid-pool, past the slots the new blocks took.
        got = _load(client, new, [hs[500]])
        assert len(got) == 1 and np.array_equal(got[0], kv.block(500 % N))
