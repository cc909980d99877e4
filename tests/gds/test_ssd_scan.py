"""Index rebuild by scanning record headers, when the journal is gone, foreign or
damaged: the blocks that are intact on disk hit again, byte for byte; torn,
damaged and overwritten records are dropped by the scan, never loaded."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from pegaflow.gds import scan
from pegaflow.gds.format import HEADER_BYTES, RecordHeader, hasher, record_bytes
from pegaflow.gds.ring import Record
from pegaflow.gds.tier import SsdTier
from tests.gds.helpers import NS, config, key, load, opened, spill


def _records(tier: SsdTier) -> dict[int, Record]:
    tables = tier.store.index.tables.values()
    return {int(h[len(b"block-") :]): rec for t in tables for h, rec in t.items()}


def test_lost_journal_rebuilt_by_scan_across_files_shards_and_wrap(
    tmp_path: Path,
) -> None:
    """Two 4 MiB files wrapped more than once, records of 4 TP shards; the
    journal deleted: the scan finds exactly the blocks the journal would have,
    in a ring that keeps working (FIFO order, later spills, later restarts)."""
    cfg = config(tmp_path, capacity=8 << 20, files=2, write_threads=1)
    ids = list(range(500))
    with opened(cfg) as tier:
        spill(tier, ids, shards=4, slot_bytes=6000)
        live = sorted(_records(tier))
        heads = [r.head for r in tier.store.rings]
    assert 100 < len(live) < 400
    os.unlink(cfg.journal_path)
    with opened(cfg) as tier:
        rec = tier.store.recovery
        assert (rec.rebuilt_by, rec.blocks, rec.torn_records) == ("scan", len(live), 0)
        assert sorted(_records(tier)) == live
        assert [r.head for r in tier.store.rings] == heads
        assert load(tier, ids, shards=4, slot_bytes=6000).tolist() == [
            i in live for i in ids
        ]
        spill(tier, list(range(500, 700)), shards=4, slot_bytes=6000)
        after = sorted(_records(tier))
        assert after[-200:] == list(range(500, 700))  # FIFO: the oldest went
        assert load(tier, after, shards=4, slot_bytes=6000).all()
        st = tier.stats()
        assert st.checksum_failures == st.header_mismatches == 0
    with opened(cfg) as tier:  # the scan left a journal behind
        assert tier.store.recovery.rebuilt_by == "journal"
        assert sorted(_records(tier)) == after


def test_garbage_journal_is_scanned_and_damaged_records_are_dropped(
    tmp_path: Path,
) -> None:
    """Journal overwritten with garbage; on disk, one record's payload torn (as a
    crash mid-write leaves it: header there, payload half old bytes), one
    record's header flipped, one record whose write never reached the disk.
    The scan drops the two it sees; none of the three is ever loaded."""
    cfg = config(tmp_path, capacity=8 << 20)
    ids = list(range(40))
    with opened(cfg) as tier:
        spill(tier, ids, slot_bytes=20000)
        recs = _records(tier)
        reserved = tier.store.reserve(NS, key(99), 20000)  # the crash: never written
        assert reserved is not None
    path = cfg.paths[0]
    with open(path, "r+b") as f:
        f.seek(recs[7].offset + HEADER_BYTES + 8192)
        f.write(os.urandom(4096))  # torn payload
        f.seek(recs[23].offset + 50)
        f.write(b"\xff")  # damaged header
    with open(cfg.journal_path, "r+b") as f:
        f.write(os.urandom(4096))
    with opened(cfg) as tier:
        rec = tier.store.recovery
        assert (rec.rebuilt_by, rec.blocks, rec.torn_records) == ("scan", 38, 2)
        ok = load(tier, [*ids, 99], slot_bytes=20000)
        assert ok.tolist() == [i not in (7, 23) for i in ids] + [False]
        st = tier.stats()
        assert st.checksum_failures == st.header_mismatches == 0  # dropped earlier
        spill(tier, [7, 23, 99], slot_bytes=20000)  # the engine recomputes them
        assert load(tier, [7, 23, 99], slot_bytes=20000).all()


def test_record_across_chunk_boundaries(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Records larger than a scan chunk, and records cut by a chunk's end, are
    read again whole: intact ones are kept, a torn one is dropped."""
    monkeypatch.setattr(scan, "CHUNK_BYTES", 64 << 10)
    cfg = config(tmp_path, capacity=8 << 20)
    with opened(cfg) as tier:
        spill(tier, list(range(12)), shards=3, slot_bytes=50000)  # 152 KiB each
        torn = _records(tier)[5]
    with open(cfg.paths[0], "r+b") as f:
        f.seek(torn.offset + torn.length - 4096)
        f.write(os.urandom(4096))
    os.unlink(cfg.journal_path)
    with opened(cfg) as tier:
        assert tier.store.recovery.blocks == 11
        assert tier.store.recovery.torn_records == 1
        ok = load(tier, list(range(12)), shards=3, slot_bytes=50000)
        assert ok.tolist() == [i != 5 for i in range(12)]


def test_scan_20k_records(tmp_path: Path) -> None:
    """20k records of 4 KiB written straight into the file (headers and
    checksums as the store writes them), no journal: all found. (100k real
    spills are timed in benchmarks/ssd.py; this prints its own time.)"""
    n, payload = 20_000, 4096
    length = record_bytes(payload)
    cfg = config(tmp_path, capacity=(n + 16) * length + (1 << 20), checksum="blake2b")
    with opened(cfg) as tier:
        store_id, start = tier.store.store_id, tier.store.rings[0].start
    data = np.zeros((n, length), np.uint8)
    data[:, HEADER_BYTES:] = np.random.default_rng(5).integers(0, 256, payload)
    data[:, HEADER_BYTES : HEADER_BYTES + 8] = np.arange(n, dtype="<u8")[:, None].view(
        np.uint8
    )  # every payload its own
    h = hasher(1)
    for i in range(n):
        row = memoryview(data[i])
        csum = h(row[HEADER_BYTES:])
        RecordHeader(NS, key(i), store_id, i + 1, payload, csum, 1).pack_into(row)
    with open(cfg.paths[0], "r+b") as f:
        f.seek(start)
        f.write(data)
    os.unlink(cfg.journal_path)
    began = time.perf_counter()
    with opened(cfg) as tier:
        seconds = time.perf_counter() - began
        assert tier.store.recovery.blocks == n
        assert tier.lookup(NS, [key(i) for i in range(n)]) == n
        assert tier.store.rings[0].head == start + n * length
        for i in (0, n // 2, n - 1):  # every byte of a few
            dst = np.zeros(payload, np.uint8)
            table = np.array([[dst.ctypes.data]], np.uint64)
            assert tier.load(NS, [key(i)], table, payload).result(30).ok.all()
            assert np.array_equal(dst, data[i, HEADER_BYTES:])
    print(f"scanned {n} records in {seconds:.2f} s")
