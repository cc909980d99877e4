"""Damage a start must survive: journal entries that are whole but name space
this store never wrote, a data file that shrank, a bad sector under the scan,
a header naming a payload larger than the store writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pegaflow.gds import io as gds_io
from pegaflow.gds import journal, scan
from pegaflow.gds import store as gds_store
from pegaflow.gds.format import ALIGN, FILE_MAGIC, record_bytes
from pegaflow.gds.ring import Record, Ring
from tests.gds.helpers import NS, config, key, load, opened, spill

SLOT = 8192
RING = Ring(0, ALIGN, 1 << 20)


def _rec(offset: int, payload: int, file: int = 0, length: int = 0) -> Record:
    rec = Record(file, offset, length or record_bytes(payload), 1, NS, key(1))
    rec.payload_len = payload
    return rec


def _head(offset: int) -> Record:
    return Record(0, offset, 0, 0)


@pytest.mark.parametrize(
    ("kind", "rec", "why"),
    [
        (journal.Kind.HEAD, _head(0), "outside the record area"),
        (journal.Kind.HEAD, _head(RING.end + ALIGN), "outside the record area"),
        (journal.Kind.RESERVE, _rec(0, SLOT), "outside the record area"),
        (journal.Kind.COMMIT, _rec(ALIGN + 512, SLOT), "off the 4 KiB grid"),
        (journal.Kind.RESERVE, _rec(ALIGN, SLOT, length=ALIGN), "other than its"),
        (journal.Kind.RESERVE, _rec(RING.end - ALIGN, SLOT), "past the file's end"),
        (journal.Kind.RESERVE, _rec(ALIGN, 1 << 40), "payload over"),
        (journal.Kind.DROP, _rec(ALIGN, SLOT, file=1), "a file past the 1"),
        (9, _rec(ALIGN, SLOT), "an unknown kind"),
    ],
)
def test_first_invalid_names_the_entry_and_why(
    kind: int, rec: Record, why: str
) -> None:
    good = _rec(ALIGN, SLOT)
    data = [
        journal.entry(journal.Kind.RESERVE, good),
        journal.entry(journal.Kind.COMMIT, good),
        journal.head_entry(RING),
        journal.entry(kind, rec),  # type: ignore[arg-type]
    ]
    entries = np.frombuffer(b"".join(data), journal._DTYPE)
    assert journal.first_invalid(entries[:3], [RING]) is None
    found = journal.first_invalid(entries, [RING])
    assert found is not None and found[0] == 3 and why in found[1]


def test_journal_head_at_the_superblock_is_not_trusted(tmp_path: Path) -> None:
    """A whole HEAD entry at offset 0 appended to the journal: the start
    rebuilds by scan, and the next spill leaves the superblock alone."""
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, list(range(5)), slot_bytes=SLOT)
    with open(cfg.journal_path, "ab") as f:
        f.write(journal.entry(journal.Kind.HEAD, _head(0)))
    with opened(cfg) as tier:
        assert tier.store.recovery.rebuilt_by == "scan"
        assert all(r.head >= r.start for r in tier.store.rings)
        spill(tier, [5], slot_bytes=SLOT)
    with open(cfg.paths[0], "rb") as f:
        assert f.read(len(FILE_MAGIC)) == FILE_MAGIC
    with opened(cfg) as tier:
        assert tier.store.recovery.reinitialised == ""
        assert load(tier, list(range(6)), slot_bytes=SLOT).all()


def test_shrunk_file_is_reinitialised(tmp_path: Path) -> None:
    """A data file cut to half its size, its journal lost: the start
    reinitialises it, saying why, instead of failing on a short read."""
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, list(range(5)), slot_bytes=SLOT)
    os.truncate(cfg.paths[0], cfg.file_bytes // 2)
    os.unlink(cfg.journal_path)
    with opened(cfg) as tier:
        assert "shrank" in tier.store.recovery.reinitialised
        assert os.path.getsize(cfg.paths[0]) == cfg.file_bytes
        spill(tier, [9], slot_bytes=SLOT)
        assert load(tier, [9], slot_bytes=SLOT).all()


def test_bad_sector_costs_its_chunk_not_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan's second 1 MiB chunk fails to read: the start goes on, every
    record clear of that chunk is back byte for byte, the rest are dropped."""
    cfg = config(tmp_path, capacity=4 << 20, write_threads=1, backend="posix")
    with opened(cfg) as tier:
        spill(tier, list(range(200)), slot_bytes=SLOT)  # 2.4 MiB: no wrap
        start = tier.store.rings[0].start
        tables = tier.store.index.tables.values()
        where = {int(h[6:]): (r.offset, r.length) for t in tables for h, r in t.items()}
    os.unlink(cfg.journal_path)
    chunk = 1 << 20
    bad_lo, bad_hi = start + chunk, start + 2 * chunk
    real_pread = gds_io.PosixIO.pread

    def bad_sector(io: gds_io.PosixIO, file: int, addr: int, n: int, at: int) -> None:
        if at < bad_lo + ALIGN and at + n > bad_lo:
            raise OSError(5, "Input/output error")
        real_pread(io, file, addr, n, at)

    monkeypatch.setattr(scan, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(gds_io.PosixIO, "pread", bad_sector)
    clear = sorted(i for i, (o, n) in where.items() if o + n <= bad_lo or o >= bad_hi)
    with opened(cfg) as tier:
        rec = tier.store.recovery
        assert (rec.rebuilt_by, rec.blocks, rec.unreadable_bytes) == (
            "scan",
            len(clear),
            chunk,
        )
        assert load(tier, list(range(200)), slot_bytes=SLOT).tolist() == [
            i in clear for i in range(200)
        ]


def test_scan_drops_a_payload_over_the_largest_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header naming 2 MiB, where the store writes at most 1 MiB: the scan
    drops it and never reads (nor allocates) it whole."""
    cfg = config(tmp_path, write_threads=1)
    with opened(cfg) as tier:
        spill(tier, [1, 2], slot_bytes=SLOT)
        spill(tier, [3], slot_bytes=2 << 20)  # crosses the 1 MiB chunks below
        spill(tier, [4], slot_bytes=SLOT)
    os.unlink(cfg.journal_path)
    monkeypatch.setattr(scan, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(scan, "MAX_PAYLOAD_BYTES", 1 << 20, raising=False)
    asked: list[int] = []
    real_buffer = scan._Scanner._buffer

    def buffer(self: scan._Scanner, nbytes: int) -> gds_io.AlignedBuffer:
        asked.append(nbytes)
        return real_buffer(self, nbytes)

    monkeypatch.setattr(scan._Scanner, "_buffer", buffer)
    with opened(cfg) as tier:
        assert tier.store.recovery.rebuilt_by == "scan"
        assert tier.lookup(NS, [key(3)]) == 0
        assert load(tier, [1, 2, 4], slot_bytes=SLOT).all()
    assert max(asked) <= 1 << 20


def test_store_refuses_a_block_over_the_largest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = record_bytes(1 << 20)
    monkeypatch.setattr(gds_store, "_MAX_RECORD_BYTES", limit, raising=False)
    with opened(config(tmp_path)) as tier:
        spill(tier, [1], slot_bytes=2 << 20)
        assert tier.stats().no_space == 1 and tier.lookup(NS, [key(1)]) == 0
        spill(tier, [2], slot_bytes=1 << 20)
        assert load(tier, [2], slot_bytes=1 << 20).all()
