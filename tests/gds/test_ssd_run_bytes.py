"""A run's header pages and journal entries are built per run (header_rows,
journal.entries): byte for byte what the per-record reference code
(RecordHeader.pack_into, journal.entry) writes, over random records;
records written by the run path, in place or staged (slots off a page),
read back byte-equal; and the staged run path writes exactly the bytes the
per-record path writes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from pegaflow.gds import journal
from pegaflow.gds.format import HEADER_BYTES, HEADER_DTYPE, RecordHeader, header_rows
from pegaflow.gds.io import AlignedBuffer, host_view
from pegaflow.gds.records import SlotTable, gather_parts, gather_staged
from pegaflow.gds.ring import Record
from pegaflow.gds.store import SsdStore
from tests.gds.helpers import config


def _random_records(rng: random.Random, n: int) -> list[Record]:
    out = []
    for _ in range(n):
        rec = Record(
            rng.randrange(8),
            rng.getrandbits(48) * 4096,
            rng.getrandbits(32),
            rng.getrandbits(64),
            rng.randbytes(16),
        )
        # trailing zero bytes must survive (numpy "S" would strip them)
        tail = b"\0" * rng.randrange(3)
        rec.block_hash = (rng.randbytes(rng.randint(1, 64)) + tail)[:64]
        rec.payload_len = rng.getrandbits(40)
        rec.checksum = rng.getrandbits(64)
        rec.checksum_id = rng.choice([1, 2, 3])
        out.append(rec)
    return out


def _reference_page(rec: Record, store_id: bytes) -> bytes:
    page = bytearray(HEADER_BYTES)
    RecordHeader(
        rec.ns_digest,
        rec.block_hash,
        store_id,
        rec.seq,
        rec.payload_len,
        rec.checksum,
        rec.checksum_id,
    ).pack_into(memoryview(page))
    return bytes(page)


@pytest.mark.parametrize("n", [1, 2, 64, 257])
def test_header_rows_are_the_packed_headers(n: int) -> None:
    rng = random.Random(n)
    recs = _random_records(rng, n)
    store_id = rng.randbytes(15) + b"\0"
    rows = header_rows(recs, store_id)
    for rec, row in zip(recs, rows, strict=True):
        page = _reference_page(rec, store_id)
        assert row.tobytes() == page[: HEADER_DTYPE.itemsize]
        assert not any(page[HEADER_DTYPE.itemsize :])
        assert RecordHeader.unpack(page).block_hash == rec.block_hash


@pytest.mark.parametrize("n", [0, 1, 2, 64, 257])
def test_journal_entries_are_the_packed_entries(n: int) -> None:
    recs = _random_records(random.Random(100 + n), n)
    for kind in journal.Kind:
        want = b"".join(journal.entry(kind, rec) for rec in recs)
        assert journal.entries(kind, recs) == want


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("skew", [0, 16])
def test_a_run_written_reads_back(tmp_path: Path, shards: int, skew: int) -> None:
    """Header pages on disk and the journal's bytes as the reference code
    makes them (RESERVE before the checksum is known, COMMIT after), and
    every payload read back byte-equal through the existing read path; skew
    16: every slot 16 bytes past a page, so the run is staged."""
    each, n = 8192, 40
    rng = np.random.default_rng(shards)
    src = AlignedBuffer(n * shards * each + 4096)
    host_view(src.address, src.size)[:] = rng.integers(0, 256, src.size, np.uint8)
    slots = src.address + skew + np.arange(n * shards, dtype=np.uint64) * each
    # shuffled rows: in place, but not one merged extent
    slots = slots.reshape(n, shards)[rng.permutation(n)]
    store = SsdStore(config(tmp_path, capacity=8 << 20))
    buf = AlignedBuffer()
    np.frombuffer(buf.view(), np.uint8)[:] = (
        0xA5  # stale bytes: a header page must not carry them
    )
    try:
        ns = bytes(range(16))
        hashes = [bytes([i + 1]) * (1 + i % 64) for i in range(n)]
        run = store.reserve_run([(ns, h, shards * each) for h in hashes])
        assert len(run) == n
        reserved = [journal.entry(journal.Kind.RESERVE, rec) for rec in run]
        assert store.write_run(run, SlotTable(slots, each), buf)
        committed = [journal.entry(journal.Kind.COMMIT, rec) for rec in run]
        with open(store.journal.path, "rb") as f:
            assert f.read().endswith(b"".join(reserved + committed))
        with open(store.cfg.paths[0], "rb") as f:
            for rec in run:
                f.seek(rec.offset)
                assert f.read(HEADER_BYTES) == _reference_page(rec, store.store_id)
        out = np.zeros((n, shards, each), np.uint8)
        dests = [[int(out[i, j].ctypes.data) for j in range(shards)] for i in range(n)]
        pinned = [store.pin(ns, h) for h in hashes]
        assert store.read_run(pinned, dests, each, buf) == [True] * n
        for i, row in enumerate(slots.tolist()):
            for j, address in enumerate(row):
                assert out[i, j].tobytes() == bytes(host_view(address, each))
    finally:
        store.close()
        buf.close()
        src.close()


def _bytes_of(parts: list[tuple[int, int]]) -> bytes:
    return b"".join(bytes(host_view(a, n)) for a, n in parts)


@pytest.mark.parametrize(
    "shards, each, skew", [(1, 8192, 16), (2, 5000, 0), (3, 4096, 64)]
)
def test_a_staged_run_is_the_per_record_bytes(
    tmp_path: Path, shards: int, each: int, skew: int
) -> None:
    """gather_staged (one copy call per run, array-built pages) against
    gather_parts (a memmove, memset and header per record) over the same
    records and slots: the same bytes in file order and the same checksums."""
    n = 33
    rng = np.random.default_rng(each + shards)
    src = AlignedBuffer(n * shards * each + 4096)
    host_view(src.address, src.size)[:] = rng.integers(0, 256, src.size, np.uint8)
    slots = src.address + skew + np.arange(n * shards, dtype=np.uint64) * each
    slots = slots.reshape(n, shards)[rng.permutation(n)]
    store = SsdStore(config(tmp_path, capacity=8 << 20))
    stale = [AlignedBuffer(), AlignedBuffer()]
    for b in stale:
        np.frombuffer(b.view(), np.uint8)[:] = 0xA5
    try:
        ns = bytes(range(16))
        run = store.reserve_run(
            [(ns, bytes([i + 1]) * 32, shards * each) for i in range(n)]
        )
        staged = gather_staged(run, slots, each, stale[0], store.store_id)
        sums = [rec.checksum for rec in run]
        for rec in run:
            rec.checksum = 0
        parts = SlotTable(slots, each).parts()
        reference, _ = gather_parts(run, parts, stale[1], store.store_id)
        assert [rec.checksum for rec in run] == sums
        assert _bytes_of(staged) == _bytes_of(reference)
        assert len(staged) == 1  # the run is one write
    finally:
        for rec in run:
            store.abort(rec)
        store.close()
        for b in stale:
            b.close()
        src.close()
