"""Loads read in place: records whose slots are 4 KiB-aligned are read straight
into the slots (header pages into a buffer, one scatter read per stretch of
records that lie back to back on disk), the rest through a bounce buffer; both
kinds mix in one read. A record that fails its checks is never loaded. Every
byte checked."""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from pegaflow.gds import io as gds_io
from pegaflow.gds import kvikio_io
from pegaflow.gds.format import HEADER_BYTES
from pegaflow.gds.tier import SsdTier
from tests.gds.helpers import NS, block, config, key, opened, spill

Parts = list[tuple[int, int]]


def _spy(tier: SsdTier, monkeypatch: pytest.MonkeyPatch) -> list[Parts]:
    """Record the parts of every scatter read the tier's backend gets."""
    calls: list[Parts] = []
    io = tier.store.io
    real = io.preadv

    def preadv(file: int, parts: Parts, offset: int) -> None:
        calls.append(list(parts))
        real(file, parts, offset)

    monkeypatch.setattr(io, "preadv", preadv)
    return calls


def _slots(n: int, shards: int, slot_bytes: int, skewed: set[int] = frozenset()):
    """Destination slots in page-aligned memory, [n, shards, slot_bytes], filled
    with 0xEE; the blocks in `skewed` sit 512 B off alignment. Returns (arrays
    per block, address table)."""
    stride = -(-(slot_bytes + 512) // 4096) * 4096
    region = mmap.mmap(-1, n * shards * stride)
    raw = np.frombuffer(region, np.uint8)
    raw[:] = 0xEE
    rows, table = [], []
    for i in range(n):
        skew = 512 if i in skewed else 0
        shard_rows = []
        for s in range(shards):
            start = (i * shards + s) * stride + skew
            shard_rows.append(raw[start : start + slot_bytes])
        rows.append(shard_rows)
        table.append([int(r.ctypes.data) for r in shard_rows])
    return rows, np.array(table, np.uint64)


def _load(
    tier: SsdTier,
    ids: list[int],
    shards: int,
    slot_bytes: int,
    skewed: set[int] = frozenset(),
) -> tuple[np.ndarray, list[list[np.ndarray]], list[int]]:
    """Load ids into fresh slots (positions in `skewed` off alignment); every
    block reported ok must equal its bytes. Returns (ok, slots, addresses of
    the aligned slots)."""
    rows, table = _slots(len(ids), shards, slot_bytes, skewed)
    res = tier.load(NS, [key(i) for i in ids], table, slot_bytes).result(timeout=30)
    for j, i in enumerate(ids):
        if res.ok[j]:
            got = np.stack(rows[j])
            assert np.array_equal(got, block(i, shards, slot_bytes)), f"block {i}"
    assert res.nbytes == int(res.ok.sum()) * shards * slot_bytes
    aligned = [int(a) for j, r in enumerate(table) if j not in skewed for a in r]
    return res.ok, rows, aligned


def _covered(calls: list[Parts], address: int, nbytes: int) -> bool:
    return any(a <= address and address + nbytes <= a + n for c in calls for a, n in c)


@pytest.mark.parametrize("shards", [1, 3])
def test_aligned_slots_are_read_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    n = 60
    with opened(
        config(tmp_path, capacity=32 << 20, queue_blocks=64, read_threads=2)
    ) as tier:
        assert spill(tier, list(range(n)), shards, 16384, aligned=True) == n
        calls = _spy(tier, monkeypatch)
        ok, _, aligned = _load(tier, list(range(n)), shards, 16384)
        assert ok.all()
        for a in aligned:  # every slot read from disk where it lies
            assert _covered(calls, a, 16384)
        # back-to-back records merged: far fewer requests than blocks
        assert len(calls) < n // 4
        assert tier.stats().blocks_read == n and tier.stats().bytes_read == (
            n * shards * 16384
        )
    with opened(config(tmp_path, capacity=32 << 20)) as tier:  # after a restart
        calls = _spy(tier, monkeypatch)
        ok, _, aligned = _load(tier, list(range(n)), shards, 16384)
        assert ok.all() and all(_covered(calls, a, 16384) for a in aligned)


def test_aligned_and_skewed_slots_in_one_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks whose slots are off alignment go through the bounce buffer, the
    others straight into their slots, in the same request."""
    n, shards = 40, 2
    skewed = {1, 2, 7, 20, 21, 22, 39}
    with opened(
        config(tmp_path, capacity=32 << 20, queue_blocks=64, read_threads=1)
    ) as tier:
        assert spill(tier, list(range(n)), shards, 8192, aligned=True) == n
        calls = _spy(tier, monkeypatch)
        ok, rows, aligned = _load(tier, list(range(n)), shards, 8192, skewed)
        assert ok.all()
        assert all(_covered(calls, a, 8192) for a in aligned)
        for j in skewed:  # never read in place: 512 B off a page
            a = int(rows[j][0].ctypes.data)
            assert not _covered(calls, a, 8192)
        assert len(calls) <= 2
        # odd-sized slots (not a multiple of 4 KiB): all staged, all equal
        assert spill(tier, list(range(100, 130)), 3, 5000) == 30
        ok, _, _ = _load(tier, list(range(100, 130)), 3, 5000)
        assert ok.all()


@pytest.mark.parametrize("where", ["payload", "last byte", "header"])
def test_damaged_record_read_in_place_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A flipped byte in a record read straight into its slots: that block is
    False, counted, dropped from the index (never loaded again), and its
    neighbours in the same request are loaded intact."""
    n, shards, slot = 12, 2, 8192
    cfg = config(tmp_path, capacity=32 << 20, queue_blocks=64, read_threads=1)
    with opened(cfg) as tier:
        assert spill(tier, list(range(n)), shards, slot, aligned=True) == n
        rec = tier.store.index.get(NS, key(5))
        assert rec is not None
        pos = {
            "payload": rec.offset + HEADER_BYTES + slot + 123,
            "last byte": rec.offset + HEADER_BYTES + shards * slot - 1,
            "header": rec.offset + 20,  # the namespace digest
        }[where]
    with open(cfg.paths[0], "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x01]))
    with opened(cfg) as tier:
        calls = _spy(tier, monkeypatch)
        ok, _, aligned = _load(tier, list(range(n)), shards, slot)
        assert ok.tolist() == [i != 5 for i in range(n)]
        assert len(calls) == 1 and all(_covered(calls, a, slot) for a in aligned)
        stats = tier.stats()
        counter = "header_mismatches" if where == "header" else "checksum_failures"
        assert getattr(stats, counter) == 1
        assert stats.blocks_read == n - 1 and stats.load_hits == n - 1
        assert stats.bytes_read == (n - 1) * shards * slot
        assert tier.lookup(NS, [key(5)]) == 0 and tier.lookup(NS, [key(6)]) == 1
        ok, _, _ = _load(tier, [4, 5, 6], shards, slot)
        assert ok.tolist() == [True, False, True]
        assert getattr(tier.stats(), counter) == 1  # a miss now, not re-read
    with opened(cfg) as tier:  # the drop is journalled
        assert tier.lookup(NS, [key(5)]) == 0
        assert _load(tier, [5], shards, slot)[0].tolist() == [False]


def test_many_parts_and_short_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More parts than one preadv takes (IOV_MAX, made small here), and a
    kernel that reads only part of each request: the rest is read again from
    where it stopped, every byte lands."""
    n, shards = 100, 4
    with opened(
        config(tmp_path, capacity=32 << 20, queue_blocks=128, read_threads=2)
    ) as tier:
        assert spill(tier, list(range(n)), shards, 4096, aligned=True) == n
        assert spill(tier, list(range(200, 230)), 2, 5000) == 30
        monkeypatch.setattr(gds_io, "IOV_MAX", 7)
        real = os.preadv
        rng = np.random.default_rng(7)

        def short(fd: int, views: list[memoryview], offset: int) -> int:
            assert len(views) <= 7
            total = sum(len(v) for v in views)
            limit = int(rng.integers(1, max(2, total // 4096))) * 4096
            cut, left = [], min(total, limit)
            for v in views:
                if not left:
                    break
                cut.append(v[:left])
                left -= len(cut[-1])
            return real(fd, cut, offset)

        monkeypatch.setattr(gds_io.os, "preadv", short)
        calls = _spy(tier, monkeypatch)
        ok, _, aligned = _load(tier, list(range(n)), shards, 4096, {3, 50})
        assert ok.all() and all(_covered(calls, a, 4096) for a in aligned)
        assert max(len(c) for c in calls) > 7  # a request went out in pieces
        ok, _, _ = _load(tier, list(range(200, 230)), 2, 5000)
        assert ok.all()
        assert tier.stats().checksum_failures == tier.stats().read_errors == 0


def test_read_that_ends_early_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that returns 0 (end of file) or fails: every record of that
    request is False, counted and dropped; other requests are unaffected. The
    posix backend always: the faults are injected into its os.preadv."""
    cfg = config(tmp_path, capacity=32 << 20, queue_blocks=64, read_threads=1)
    with opened(dataclasses.replace(cfg, backend="posix")) as tier:
        assert spill(tier, list(range(10)), 1, 8192, aligned=True) == 10
        real = os.preadv
        mode = ["eof"]

        def broken(fd: int, views: list[memoryview], offset: int) -> int:
            if mode[0] == "eof":
                return 0
            raise OSError(errno.EIO, "disk gone")

        monkeypatch.setattr(gds_io.os, "preadv", broken)
        ok, _, _ = _load(tier, [0, 1, 2], 1, 8192)
        assert not ok.any() and tier.stats().read_errors == 3
        mode[0] = "eio"
        ok, _, _ = _load(tier, [3], 1, 8192)
        assert not ok.any() and tier.stats().read_errors == 4
        monkeypatch.setattr(gds_io.os, "preadv", real)
        ok, _, _ = _load(tier, list(range(10)), 1, 8192)
        assert ok.tolist() == [i > 3 for i in range(10)]
        assert tier.stats().blocks_read == 6


def test_missing_and_other_geometry_split_a_load(tmp_path: Path) -> None:
    """Blocks missing from SSD, or of another slot geometry than asked, sit
    between loaded ones: those are False (other geometry stays on SSD), the
    rest loaded byte for byte."""
    with opened(
        config(tmp_path, capacity=32 << 20, queue_blocks=64, read_threads=1)
    ) as tier:
        assert spill(tier, list(range(10)), 2, 8192, aligned=True) == 10
        assert spill(tier, [10, 11], 1, 8192, aligned=True) == 2
        assert spill(tier, list(range(12, 16)), 2, 8192, aligned=True) == 4
        ids = [0, 1, 10, 2, 99, 3, 11, 12, 13, 14, 15]
        ok, _, _ = _load(tier, ids, 2, 8192)
        assert ok.tolist() == [i not in (10, 11, 99) for i in ids]
        assert tier.lookup(NS, [key(10), key(11)]) == 2
        stats = tier.stats()
        assert stats.header_mismatches == stats.checksum_failures == 0


class _FakeFuture:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class _FakeCuFile:
    """kvikio.CuFile in compat mode, over os.pread / os.pwrite."""

    reads: list[int] = []

    def __init__(self, path: str, flags: str) -> None:
        self.fd = os.open(path, os.O_RDWR)

    def pread(self, buf: np.ndarray, size: int, file_offset: int) -> _FakeFuture:
        data = os.pread(self.fd, size, file_offset)
        buf[: len(data)] = np.frombuffer(data, np.uint8)
        _FakeCuFile.reads.append(int(buf.ctypes.data))
        return _FakeFuture(len(data))

    def pwrite(self, buf: np.ndarray, size: int, file_offset: int) -> _FakeFuture:
        return _FakeFuture(os.pwrite(self.fd, buf[:size].tobytes(), file_offset))

    def is_direct_io_supported(self) -> bool:
        return False

    def close(self) -> None:
        os.close(self.fd)


def test_kvikio_reads_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvikio's preadv twin (one pread per part), against a stand-in module."""
    settings: dict[str, object] = {}
    defaults = types.SimpleNamespace(
        is_compat_mode_preferred=lambda: True,
        set=settings.__setitem__,
        get=settings.__getitem__,
    )
    fake = types.SimpleNamespace(
        CuFile=_FakeCuFile, defaults=defaults, __version__="fake"
    )
    monkeypatch.setitem(sys.modules, "kvikio", fake)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)  # a submodule
    monkeypatch.setattr(kvikio_io, "unavailable", lambda: None)
    monkeypatch.setattr(_FakeCuFile, "reads", [])
    cfg = config(tmp_path, capacity=32 << 20, backend="kvikio", read_threads=1)
    with opened(cfg) as tier:
        assert tier.mode == "kvikio-compat"
        assert spill(tier, list(range(20)), 2, 8192, aligned=True) == 20
        ok, _, aligned = _load(tier, list(range(20)), 2, 8192, {4})
        assert ok.all()
        assert set(aligned) <= set(_FakeCuFile.reads)
