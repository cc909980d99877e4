"""Damage on disk: flipped payload or header bytes, torn records, torn or corrupt
journal entries. Whatever happens, a load never returns wrong bytes."""

from __future__ import annotations

import os
from pathlib import Path

from pegaflow.gds.format import HEADER_BYTES
from pegaflow.gds.ring import Record
from pegaflow.gds.tier import SsdTier
from tests.gds.helpers import NS, config, key, load, opened, spill

SLOT = 10000


def _record(tier: SsdTier, i: int) -> Record:
    rec = tier.store.index.get(NS, key(i))
    assert rec is not None
    return rec


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_flipped_payload_is_a_counted_miss_and_stays_gone(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, list(range(5)), slot_bytes=SLOT)
        rec = _record(tier, 2)
        pos = (rec.offset + HEADER_BYTES + 7777, _record(tier, 4).offset + 99)
    _flip(cfg.paths[0], pos[0])  # payload of block 2
    _flip(cfg.paths[0], pos[1])  # header of block 4
    with opened(cfg) as tier:
        assert load(tier, list(range(5)), slot_bytes=SLOT).tolist() == [
            True,
            True,
            False,
            True,
            False,
        ]
        st = tier.stats()
        assert st.checksum_failures == 1 and st.header_mismatches == 1
        assert tier.lookup(NS, [key(i) for i in range(5)]) == 2  # dropped
    with opened(cfg) as tier:  # the drop was journaled
        assert tier.store.recovery.blocks == 3
        assert tier.lookup(NS, [key(2)]) == tier.lookup(NS, [key(4)]) == 0
        spill(tier, [2], slot_bytes=SLOT)  # the engine path recomputes and spills
        assert load(tier, [2], slot_bytes=SLOT).all()


def test_torn_record_is_dropped_at_restart(tmp_path: Path) -> None:
    """Crash between RESERVE and COMMIT, half the record on disk: the record is
    not indexed after restart; the record before it still is."""
    cfg = config(tmp_path)
    tier = SsdTier(cfg)
    spill(tier, [1], slot_bytes=SLOT)
    store = tier.store
    rec = store.reserve(NS, key(2), SLOT)
    assert rec is not None
    half = rec.length // 2 // 4096 * 4096
    with open(cfg.paths[0], "r+b") as f:
        f.seek(rec.offset)
        f.write(os.urandom(half))
    # the crash: no COMMIT; the kernel closes the files and drops the lock
    store.journal.close()
    store.io.close()
    for fd in store._locks:
        os.close(fd)
    tier.close = lambda: None  # type: ignore[method-assign]
    with opened(cfg) as again:
        assert again.store.recovery.torn_records == 1
        assert again.lookup(NS, [key(1), key(2)]) == 1
        assert load(again, [1, 2], slot_bytes=SLOT).tolist() == [True, False]
        spill(again, [3], slot_bytes=SLOT)  # the torn space is reused cleanly
        assert load(again, [1, 3], slot_bytes=SLOT).all()


def test_torn_journal_tail(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, list(range(10)), slot_bytes=SLOT)
    with open(cfg.journal_path, "ab") as f:
        f.write(b"\x02" + os.urandom(60))  # half an entry: the crash mid-append
    with opened(cfg) as tier:
        assert tier.store.recovery.torn_entries == 1
        assert tier.store.recovery.blocks == 10
        assert load(tier, list(range(10)), slot_bytes=SLOT).all()
    with opened(cfg) as tier:  # rewritten clean at the previous start
        assert tier.store.recovery.torn_entries == 0


def test_corrupt_journal_entry_falls_back_to_the_header_scan(tmp_path: Path) -> None:
    """A bad entry before the journal's end is damage, not a crash mid-append:
    the replay cannot trust what follows it, so the index is rebuilt from the
    record headers and every block is back, byte for byte."""
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, list(range(10)), slot_bytes=SLOT)
    with opened(cfg) as tier:  # journal now: snapshot of 10 records + head
        spill(tier, list(range(10, 20)), slot_bytes=SLOT)
    entry = 136
    size = os.path.getsize(cfg.journal_path)
    _flip(cfg.journal_path, size - 5 * entry + 40)  # one of the last records
    with opened(cfg) as tier:
        rec = tier.store.recovery
        assert (rec.rebuilt_by, rec.torn_entries, rec.blocks) == ("scan", 5, 20)
        assert load(tier, list(range(20)), slot_bytes=SLOT).all()
        assert tier.stats().checksum_failures == 0
    with opened(cfg) as tier:  # the scan wrote a clean journal
        assert tier.store.recovery.rebuilt_by == "journal"
        assert tier.store.recovery.blocks == 20
