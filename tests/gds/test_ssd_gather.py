"""Spills written in place: records whose slots are 4 KiB-aligned go to disk
straight from the slots in one gather write (header pages from a buffer), the
rest through a staging copy; both kinds mix in one run. Every byte checked."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from pegaflow.gds import io as gds_io
from pegaflow.gds.format import CHECKSUM_IDS, hash_parts, hasher
from pegaflow.gds.io import host_view
from tests.gds.helpers import (
    NS,
    addresses,
    block,
    config,
    key,
    load,
    opened,
    page_aligned,
    spill,
)


def _spy(tier: object, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Record the parts of every gather write the tier's backend gets."""
    calls: list[list[tuple[int, int]]] = []
    io = tier.store.io  # type: ignore[attr-defined]
    real = io.pwritev

    def pwritev(file: int, parts: list[tuple[int, int]], offset: int) -> None:
        calls.append(list(parts))
        real(file, parts, offset)

    monkeypatch.setattr(io, "pwritev", pwritev)
    return calls


@pytest.mark.parametrize("shards", [1, 3])
def test_aligned_slots_are_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    with opened(config(tmp_path, capacity=32 << 20, queue_blocks=64)) as tier:
        calls = _spy(tier, monkeypatch)
        held = [page_aligned(block(i, shards, 16384)) for i in range(60)]
        for i, data in enumerate(held):
            assert tier.spill(NS, key(i), addresses(data), 16384)
        assert tier.flush(timeout=30)
        spans = [(a, a + n) for parts in calls for a, n in parts]
        for s in (a for data in held for a in addresses(data)):
            # every slot went to disk from where it lies (adjacent ones merged)
            assert any(lo <= s and s + 16384 <= hi for lo, hi in spans)
        assert load(tier, list(range(60)), shards, 16384).all()
    with opened(config(tmp_path, capacity=32 << 20)) as tier:  # and after restart
        assert load(tier, list(range(60)), shards, 16384).all()


@pytest.mark.parametrize("aligned", [True, False])
def test_release_comes_after_the_bytes_are_out(tmp_path: Path, aligned: bool) -> None:
    """The release callback scribbles over the slots (as the pool reusing them
    would): what was written must be the bytes from before the release."""
    slot_bytes = 16384 if aligned else 12000
    copy = page_aligned if aligned else np.ascontiguousarray
    held = [copy(block(i, 2, slot_bytes)) for i in range(40)]
    released: list[int] = []

    def release(i: int) -> None:
        released.append(i)
        held[i][...] = 0xEE

    with opened(config(tmp_path, capacity=32 << 20, queue_blocks=64)) as tier:
        for i, data in enumerate(held):
            assert tier.spill(
                NS, key(i), addresses(data), slot_bytes, lambda i=i: release(i)
            )
        assert tier.flush(timeout=30)
        assert sorted(released) == list(range(40))  # each exactly once
        assert load(tier, list(range(40)), 2, slot_bytes).all()


def test_aligned_and_staged_records_in_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One writer held in the first spill's release while the rest queue up:
    they go out as one run mixing in-place slots, skewed slots (staged) and
    slots whose size is not a multiple of 4 KiB (staged, padding zeroed)."""
    gate = threading.Event()
    cfg = config(tmp_path, capacity=32 << 20, queue_blocks=64, write_threads=1)
    kinds = []
    for i in range(48):
        if i % 3 == 0:
            kinds.append((page_aligned(block(i, 2, 8192)), 8192))
        elif i % 3 == 1:  # 4 KiB-aligned size, 64 B past alignment
            raw = page_aligned(np.zeros((2 * 8192 + 64,), np.uint8))
            data = raw[64:].reshape(2, 8192)
            data[...] = block(i, 2, 8192)
            kinds.append((data, 8192))
        else:
            kinds.append((page_aligned(block(i, 2, 6000)), 6000))
    with opened(cfg) as tier:
        calls = _spy(tier, monkeypatch)
        for i, (data, slot) in enumerate(kinds):
            first = (lambda: gate.wait(10)) if i == 0 else None
            assert tier.spill(NS, key(i), addresses(data), slot, first)
        gate.set()
        assert tier.flush(timeout=30)
        assert len(calls) <= 3  # the first spill, then one run (or two: a ring end)
        for i, (data, slot) in enumerate(kinds):
            dst = np.zeros((1, 2, slot), np.uint8)
            table = np.array([addresses(dst[0])], np.uint64)
            ok = tier.load(NS, [key(i)], table, slot).result(timeout=10).ok
            assert ok.all() and np.array_equal(dst[0], data), f"block {i}"
        # the padding of a staged record is zeros, not stale buffer bytes
        rec = tier.store.index.get(NS, key(2))
        assert rec is not None
        with open(cfg.paths[0], "rb") as f:
            f.seek(rec.offset + 4096 + rec.payload_len)
            pad = f.read(rec.length - 4096 - rec.payload_len)
        assert pad == bytes(len(pad))


def test_many_parts_and_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More parts than one pwritev takes (IOV_MAX, made small here), and a
    kernel that writes only part of some requests (whole ones between): the
    rest is sent again from where it stopped, every byte lands once."""
    monkeypatch.setattr(gds_io, "IOV_MAX", 7)
    real = os.pwritev
    rng = np.random.default_rng(5)

    def short(fd: int, views: list[memoryview], offset: int) -> int:
        total = sum(len(v) for v in views)
        limit = int(rng.integers(1, total // 4096 + 2)) * 4096  # at times whole
        cut, left = [], min(total, limit)
        for v in views:
            if not left:
                break
            cut.append(v[:left])
            left -= len(cut[-1])
        return real(fd, cut, offset)

    monkeypatch.setattr(gds_io.os, "pwritev", short)
    with opened(config(tmp_path, capacity=32 << 20, queue_blocks=128)) as tier:
        assert spill(tier, list(range(120)), shards=4, slot_bytes=4096, aligned=True)
        assert load(tier, list(range(120)), 4, 4096).all()
        assert spill(tier, list(range(120, 150)), shards=2, slot_bytes=5000)
        assert load(tier, list(range(120)), 4, 4096).all()
        assert load(tier, list(range(120, 150)), 2, 5000).all()


def test_failed_in_place_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write error: the run is dropped and counted, each slot released once,
    its space free for the next spills."""
    released: list[int] = []
    with opened(config(tmp_path, capacity=4 << 20, queue_blocks=16)) as tier:
        io = tier.store.io
        real = io.pwritev

        def broken(file: int, parts: list[tuple[int, int]], offset: int) -> None:
            raise OSError(errno.EIO, "disk gone")

        monkeypatch.setattr(io, "pwritev", broken)
        held = [page_aligned(block(i, 1, 8192)) for i in range(8)]
        done = released.append
        for i, data in enumerate(held):
            tier.spill(NS, key(i), addresses(data), 8192, lambda i=i: done(i))
        assert tier.flush(timeout=30)
        assert sorted(released) == list(range(8))
        assert tier.stats().write_errors == 8 and tier.lookup(NS, [key(0)]) == 0
        monkeypatch.setattr(io, "pwritev", real)
        spill(tier, list(range(8, 400)), slot_bytes=8192, aligned=True)  # wraps
        assert tier.stats().no_space == 0
        assert load(tier, list(range(390, 400)), slot_bytes=8192).all()


@pytest.mark.parametrize("algo", sorted(CHECKSUM_IDS))
def test_checksum_of_parts_is_the_checksum_of_the_whole(algo: str) -> None:
    if algo == "blake3":
        pytest.importorskip("blake3")
    ident = CHECKSUM_IDS[algo]
    data = page_aligned(block(3, 4, 5000))
    whole = hasher(ident)(memoryview(data.reshape(-1)))
    parts = [host_view(a, 5000) for a in addresses(data)]
    assert hash_parts(ident, parts) == whole
    assert hash_parts(ident, [memoryview(data.reshape(-1))]) == whole
    if algo == "blake2b":
        want = hashlib.blake2b(data.tobytes(), digest_size=8).digest()
        assert whole == int.from_bytes(want, "little")
