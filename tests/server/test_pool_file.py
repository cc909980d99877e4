"""Warm restart of L1 through real servers: --pool-file kept across SIGKILL and
SIGTERM, damaged or torn slots dropped, one server per pool, another geometry
refused or reinitialised, an old regular pool file adopted. The kept pool is a
sealed memfd its keeper holds at PATH (tests/server/test_pool_keeper.py): the
tests read and damage its bytes through the keeper's descriptor, as its owner
could."""

from __future__ import annotations

import json
import mmap
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pegaflow.cache.pool_file import (
    _SUPER,
    FORMATS,
    GRANULE,
    META_OFFSET,
    ROW,
    SEALED,
    STATES,
    SUPER_BYTES,
    VERSION,
    WRITING,
)
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.results import QueryResult
from tests.keeper_tools import mapped, to_old_file
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, ServerProc, _env

N = 64  # blocks of 16 KiB (LocalKV: 4 layers x 4 KiB): no eviction in 16 MiB
SHM = Path("/dev/shm")


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """Pool files where docs/operations.md puts them, in /dev/shm: on the H200
    host CUDA cannot pin a file under /tmp (cudaErrorInvalidValue), and a GPU
    host's server pins its pool."""
    if not SHM.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="pegaflow-test-", dir=SHM) as d:
        yield Path(d)


def _flags(tmp: Path, *extra: str) -> tuple[str, ...]:
    return ("--pool-size", "16mb", "--pool-file", str(tmp / "pool.bin"), *extra)


def _save(server: ServerProc, kv: LocalKV) -> tuple[list[bytes], list[np.ndarray]]:
    """N random blocks saved and acknowledged; their hashes and bytes."""
    hs = hashes(N)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "a", "ns")
        assert client.save("a", list(range(N)), hs).stored == N
    return hs, [kv.block(i).copy() for i in range(N)]


def settled(client: PegaflowClient, inst: str, hs: list[bytes]) -> QueryResult:
    """A query asked again while it answers `loading` (a restarted server's
    blocks not checked yet: pegaflow.server.pool_check), as an engine does."""
    deadline = time.monotonic() + 60
    while (res := client.query(inst, hs)).loading:
        assert time.monotonic() < deadline, "still loading after 60 s"
        time.sleep(0.01)
    return res


def checked(server: ServerProc) -> dict:
    """/health's pool_recovered once the restart's check has run through."""
    deadline = time.monotonic() + 60
    while (report := _health(server)["pool_recovered"])["unchecked"]:
        assert time.monotonic() < deadline, f"check unfinished after 60 s: {report}"
        time.sleep(0.05)
    return report


def _hits(server: ServerProc, hs: list[bytes], want: list[np.ndarray]) -> int:
    """Another engine of the namespace: its hit prefix, loaded into other block
    ids and compared byte for byte."""
    kv = LocalKV(seed=77)
    with PegaflowClient(server.addr, 10) as client:
        kv.register(client, "b", "ns")
        res = settled(client, "b", hs)
        if res.num_blocks:
            dst = list(range(N - 1, N - 1 - res.num_blocks, -1))
            client.load("b", res.lease_id, dst)
            for i, b in enumerate(dst):
                assert np.array_equal(kv.block(b), want[i]), f"block {i}"
        return res.num_blocks


def _health(server: ServerProc) -> dict:
    return json.loads(server.get("/health")[1])


def _super(m: mmap.mmap) -> tuple:
    return _SUPER.unpack(m[: _SUPER.size])


def _rows(m: mmap.mmap) -> np.ndarray:
    """The slot rows, a view of the mapped pool (writes go to the pool)."""
    return np.ndarray((_super(m)[4] // GRANULE,), ROW, m, SUPER_BYTES)


def _data_offset(m: mmap.mmap) -> int:
    return _super(m)[6]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_restart_on_the_same_pool_file_hits_every_acknowledged_block(
    server_factory, tmp_path: Path, sig: int
) -> None:
    """Scenario: engine A saves 64 blocks (only in DRAM, none evicted), the
    server dies (SIGKILL right after the acknowledgement, or SIGTERM), a new
    server starts on the same --pool-file: engine B, registering the same
    namespace, hits all 64 and loads them byte-equal."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=1))
    server.stop(sig)
    server = server_factory(*_flags(tmp_path))
    report = _health(server)["pool_recovered"]
    assert report["blocks"] == N and report["torn"] == 0
    if sig == signal.SIGTERM:  # the sealer drained at exit: every slot checked
        assert report["unsealed"] == 0
    assert _hits(server, hs, want) == N
    assert server.metric("pegaflow_resident_blocks") == N


def test_damaged_and_torn_slots_are_dropped_never_served(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: after a SIGTERM (every slot sealed), block 10's bytes are
    flipped in the file and block 20's row is left WRITING (as a save in
    flight at a SIGKILL leaves it); the restarted server drops both: the hit
    prefix stops at block 10, and the blocks between are byte-equal."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=2))
    server.stop(signal.SIGTERM)
    with mapped(tmp_path / "pool.bin") as m:
        rows = _rows(m)
        hash_of = {
            bytes(r["hash"][: r["hash_len"]]): i
            for i, r in enumerate(rows)
            if r["state"] == SEALED
        }
        assert len(hash_of) == N
        at = _data_offset(m) + int(rows["offset"][hash_of[hs[10]]]) + 777
        m[at] ^= 0x40
        rows["state"][hash_of[hs[20]]] = WRITING
        del rows
    server = server_factory(*_flags(tmp_path))
    report = checked(server)
    assert (report["blocks"], report["bad_checksum"], report["torn"]) == (N - 2, 1, 1)
    assert _hits(server, hs, want) == 10
    assert _hits(server, hs[11:20], want[11:20]) == 9


def _failed_start(*args: str) -> tuple[int, str]:
    argv = [sys.executable, "-m", "pegaflow.cli", "--addr", "127.0.0.1:0"]
    argv += ["--no-http", "--no-progress", *args]
    proc = subprocess.run(
        argv, env=_env(), cwd=ROOT, capture_output=True, timeout=60, check=False
    )
    return proc.returncode, proc.stderr.decode()


def test_two_servers_on_one_pool_file_are_refused(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: a second server started on a pool file a live server holds
    exits with a message naming the flag and the holder's pid; the first keeps
    serving its blocks."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=3))
    rc, err = _failed_start(*_flags(tmp_path))
    assert rc == 2 and "Traceback" not in err
    assert "--pool-file" in err and f"pid {server.pid}" in err
    assert _hits(server, hs, want) == N


def test_another_geometry_is_refused_or_reinitialised(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: a pool file of 16 MiB, then a server with --pool-size 32mb:
    with --pool-on-mismatch refuse it exits naming both sizes and the file is
    untouched (a 16 MiB server still hits); with reinit it starts afresh
    (no hits) and says why in its log."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=4))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    other = ("--pool-size", "32mb", "--pool-file", str(path))
    rc, err = _failed_start(*other, "--pool-on-mismatch", "refuse")
    assert rc == 2 and "--pool-on-mismatch reinit" in err and "16777216 B" in err
    server = server_factory(*_flags(tmp_path))
    assert _hits(server, hs, want) == N
    server.stop(signal.SIGTERM)
    server = server_factory(*other)
    assert _health(server)["pool_recovered"]["blocks"] == 0
    assert _hits(server, hs, want) == 0
    assert "reinitialising it" in server.log.read_text()


def _as_format_1(m: mmap.mmap) -> None:
    """Rewrite a kept pool as a server of format 1 left it: the same layout,
    its SEALED rows' checksums blake3 (64 bits of it) over the row's meta and
    the slot, and version 1 in the superblock."""
    blake3 = pytest.importorskip("blake3")
    rows, offset = _rows(m), _data_offset(m)
    raw = rows.view(np.uint8).reshape(len(rows), ROW.itemsize)
    data = np.ndarray((_super(m)[4],), np.uint8, m, offset)
    for i in np.flatnonzero(rows["state"] == SEALED).tolist():
        off, n = int(rows["offset"][i]), int(rows["slot_bytes"][i])
        h = blake3.blake3(raw[i, META_OFFSET:].tobytes())
        h.update(data[off : off + n])
        rows["checksum"][i] = int.from_bytes(h.digest(8), "little")
    del rows, raw, data
    head = list(_super(m))
    head[1] = 1
    m[: _SUPER.size] = _SUPER.pack(*head)


def _as_format_2(m: mmap.mmap) -> None:
    """Rewrite a kept pool as a server of format 2 left it: the same rows,
    checksums and bytes, its state words 0..3, version 2 in the superblock."""
    rows = _rows(m)
    state = rows["state"].copy()
    for old, now in enumerate(STATES):
        rows["state"][state == now] = old
    del rows
    head = list(_super(m))
    head[1] = 2
    m[: _SUPER.size] = _SUPER.pack(*head)


@pytest.mark.parametrize("kept_as", ["keeper", "old file"])
def test_a_pool_of_format_2_is_kept_and_every_block_comes_back(
    server_factory, tmp_path: Path, kept_as: str
) -> None:
    """Scenario: 64 blocks kept by a server of format 2 (the state words
    one bit apart), in its keeper's memfd or in the regular file servers
    before 2026-12-05 kept: this server rewrites the rows' states in place,
    says so, checks every block against its unchanged checksum and serves
    all 64 byte-equal; a row whose word is neither format's is dropped as
    damaged; the pool is format 3 from then on."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=6))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    with mapped(path) as m:
        _as_format_2(m)
        assert (_rows(m)["state"] == 3).sum() == N
        _rows(m)["state"][-1] = 7  # a word format 2 never wrote: damage
    if kept_as == "old file":
        to_old_file(path)
    server = server_factory(*_flags(tmp_path, "--pool-on-mismatch", "refuse"))
    assert _hits(server, hs, want) == N
    report = checked(server)
    assert (report["blocks"], report["bad_checksum"], report["damaged"]) == (N, 0, 1)
    assert "kept as format 3" in server.log.read_text()
    server.stop(signal.SIGTERM)
    with mapped(path) as m:
        assert _super(m)[1] == VERSION
        assert (_rows(m)["state"] == SEALED).sum() == N


def test_a_pool_of_format_2_and_another_size_is_refused_naming_format_2(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: 64 blocks kept by a server of format 2 at 16 MiB; a server
    started with --pool-size 32mb and --pool-on-mismatch refuse exits naming
    the flag, the file's format (2, not this server's: it was once named as
    this format, as if only its size differed) and both sizes, and leaves the
    file as it was."""
    server = server_factory(*_flags(tmp_path))
    _save(server, LocalKV(seed=7))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    with mapped(path) as m:
        _as_format_2(m)
    other = ("--pool-size", "32mb", "--pool-file", str(path))
    rc, err = _failed_start(*other, "--pool-on-mismatch", "refuse")
    assert rc == 2 and "Traceback" not in err
    assert f"holds a pool of format 2 ({FORMATS[2]}), 16777216 B" in err
    assert f"needs format {VERSION} ({FORMATS[VERSION]}), 33554432 B" in err
    assert "--pool-on-mismatch reinit" in err
    with mapped(path) as m:  # refused: untouched
        assert _super(m)[1] == 2 and (_rows(m)["state"] == 3).sum() == N


def test_a_file_of_the_blake3_format_is_refused_or_reinitialised(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: 64 blocks kept in a pool file written by the previous format
    (1: blake3 slot checksums; same size and slabs). With --pool-on-mismatch
    refuse the server exits naming both formats and the flag, and leaves the
    file as it was; with reinit (the default) it starts afresh and says why:
    no block is recovered and none is checked against the wrong hash (no
    checksum failures), every query a miss."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=5))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    with mapped(path) as m:
        _as_format_1(m)
    rc, err = _failed_start(*_flags(tmp_path, "--pool-on-mismatch", "refuse"))
    assert rc == 2 and "Traceback" not in err
    assert "format 1 (blake3 slot checksums)" in err
    assert f"format {VERSION} ({FORMATS[VERSION]})" in err
    assert "--pool-on-mismatch reinit" in err
    with mapped(path) as m:  # refused: untouched
        assert _super(m)[1] == 1 and (_rows(m)["state"] == SEALED).sum() == N
    server = server_factory(*_flags(tmp_path))
    report = _health(server)["pool_recovered"]
    assert (report["blocks"], report["bad_checksum"]) == (0, 0)
    assert _hits(server, hs, want) == 0
    log = server.log.read_text()
    assert "format 1 (blake3 slot checksums)" in log and "reinitialising it" in log
    with mapped(path) as m:
        assert _super(m)[1] == VERSION


@pytest.mark.parametrize("size", [100, 16 << 10])
def test_a_truncated_old_pool_file_is_named_and_reinitialised(
    server_factory, tmp_path: Path, size: int
) -> None:
    """Scenario: a pool file as servers before 2026-12-05 kept it (a regular
    file), truncated (to 100 B: under its 4 KiB superblock page; to 16 KiB:
    its superblock whole). It was refused as "not a pool file" even with
    --pool-on-mismatch reinit, without its size. Now refuse names the size it
    has and the size it needs; reinit starts afresh."""
    server = server_factory(*_flags(tmp_path))
    _save(server, LocalKV(seed=5))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    to_old_file(path)
    os.truncate(path, size)
    rc, err = _failed_start(*_flags(tmp_path, "--pool-on-mismatch", "refuse"))
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err, err
    assert f"{size} B" in line and "truncated" in line, line
    assert path.stat().st_size == size  # refused: untouched
    server = server_factory(*_flags(tmp_path))
    assert _health(server)["pool_recovered"]["blocks"] == 0
    assert "reinitialising it" in server.log.read_text()
    assert path.is_socket()


def test_a_short_file_that_is_no_pool_file_is_refused_naming_its_size(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pool.bin"
    path.write_bytes(b"notes\n" * 10)
    path.chmod(0o600)
    rc, err = _failed_start(*_flags(tmp_path))
    assert rc == 2 and "60 B" in err and "not a pool file" in err, err
    assert path.read_bytes() == b"notes\n" * 10


def test_an_old_pool_file_is_adopted_once_with_its_blocks(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: an upgrade. The pool file a server before 2026-12-05 left
    (a regular file, 64 blocks, SIGKILL) is adopted: PATH becomes the keeper's
    socket, and every block is served byte-equal."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=8))
    server.stop(signal.SIGKILL)
    path = tmp_path / "pool.bin"
    to_old_file(path)
    server = server_factory(*_flags(tmp_path))
    assert "adopting the pool file" in server.log.read_text()
    assert path.is_socket() and not list(tmp_path.glob("pool.bin.*"))
    assert _hits(server, hs, want) == N


def test_an_old_pool_file_at_a_path_no_keeper_can_bind_is_left_whole(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: an old pool file at a path too long for its keeper's unix
    socket (older servers took it). The start used to copy it into a memfd,
    tearing and punching the file as it went, and only then fail to start
    the keeper: every block lost. Now it is refused first, naming the flag,
    and the file is untouched: moved to a shorter path, it is adopted whole."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=8))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    to_old_file(path)
    before = path.read_bytes()
    deep = tmp_path / ("d" * max(1, 92 - len(str(tmp_path)) - 10))
    deep.mkdir()
    long = deep / "pool.bin"
    path.rename(long)
    assert len(os.fsencode(str(long))) > 91
    rc, err = _failed_start("--pool-size", "16mb", "--pool-file", str(long))
    assert rc == 2 and "--pool-file" in err and "shorter path" in err, err
    assert long.read_bytes() == before
    long.rename(path)
    server = server_factory(*_flags(tmp_path))
    assert _hits(server, hs, want) == N


def test_a_lock_held_by_another_process_names_that_process(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: another process (here not a server: a server of the version
    before 2026-12-05 holds it so) holds a flock on an old pool file; the
    refusal named the pid in the superblock, the last server's, long gone."""
    server = server_factory(*_flags(tmp_path))
    stale = server.pid
    server.stop(signal.SIGTERM)
    to_old_file(tmp_path / "pool.bin")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time; f = open(sys.argv[1], 'rb'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(tmp_path / "pool.bin")],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == b"held"
        rc, err = _failed_start(*_flags(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2 and f"pid {holder.pid}" in err and f"pid {stale}" not in err, err


def test_a_pool_file_once_readable_by_others_is_replaced(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: an old pool file was mode 0644; another user mapped it. The
    server chmod'ed it 600 and kept the same inode, so that reader saw every
    later tenant's blocks. Now its blocks are adopted into a new memfd and the
    path becomes a socket: the reader's mapping holds none of the blocks saved
    after."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=6))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    to_old_file(path)
    path.chmod(0o644)
    with open(path, "rb") as f:
        seen = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # the other reader
    try:
        server = server_factory(*_flags(tmp_path))
        assert "was mode 644; now 600" in server.log.read_text()
        assert path.is_socket() and stat.S_IMODE(path.lstat().st_mode) == 0o600
        assert _hits(server, hs, want) == N  # its blocks, adopted
        hs, want = _save(server, LocalKV(seed=7))
        assert _hits(server, hs, want) == N  # the new pool serves
        page = want[0].tobytes()[:4096]
        assert seen.find(page) == -1  # and the old mapping never sees it
    finally:
        seen.close()
