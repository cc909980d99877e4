"""Payload checksums of the SSD records: xxh3-64 by default, blake3 and blake2b
(the defaults before) still read, a record of each kind in one store, and files
naming a checksum this server does not know refused or started afresh."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from pegaflow.common import checksum_rows
from pegaflow.gds import SsdConfig, SsdError, SsdTier
from pegaflow.gds import format as gds_format
from pegaflow.gds import store as gds_store
from pegaflow.gds.format import HEADER_BYTES, checksum_id, hash_parts, hasher
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

ALGOS = ("xxh3", "blake3", "blake2b")
SLOT = 10000  # not a multiple of 4 KiB: the staged path, payload mid-page
FUTURE_ID = 200  # an id no version of this server has used


def _ids(tier: SsdTier) -> set[int]:
    tables = tier.store.index.tables.values()
    return {rec.checksum_id for table in tables for rec in table.values()}


def test_default_is_xxh3(tmp_path: Path) -> None:
    assert checksum_id("auto") == gds_format.CHECKSUM_IDS["xxh3"] == 3
    assert SsdConfig((str(tmp_path / "c"),), 16 << 20).checksum == "auto"
    with opened(config(tmp_path)) as tier:
        spill(tier, [1, 2])
        assert _ids(tier) == {3}


def test_ids_and_values_are_stable() -> None:
    """The ids and digests are on disk: what HEAD~ wrote (blake2b, blake3,
    values taken from that code) must hash the same here."""
    data = memoryview(bytes(range(256)) * 64)
    assert gds_format.CHECKSUM_IDS == {"blake2b": 1, "blake3": 2, "xxh3": 3}
    assert hasher(1)(data) == 0xDD5E0A7605E66D07
    assert hasher(2)(data) == 0xA311004B7E369DD4
    assert hasher(3)(data) == 0xC96B04EBEFA8F6DC
    for cid in (1, 2, 3):  # hashed in parts as in place, whole as in the scan
        assert hash_parts(cid, [data[:100], data[100:4096], data[4096:]]) == (
            hasher(cid)(data)
        )


@pytest.mark.parametrize("algo", ALGOS)
def test_round_trip_and_restart_with_each(tmp_path: Path, algo: str) -> None:
    """Spill, load, restart from the journal, restart by the header scan."""
    cfg = config(tmp_path, checksum=algo)
    with opened(cfg) as tier:
        spill(tier, list(range(8)), shards=2, slot_bytes=SLOT)
        assert _ids(tier) == {gds_format.CHECKSUM_IDS[algo]}
        assert load(tier, list(range(8)), shards=2, slot_bytes=SLOT).all()
    with opened(cfg) as tier:
        assert tier.store.rebuilt_by == "journal"
        assert load(tier, list(range(8)), shards=2, slot_bytes=SLOT).all()
    os.unlink(cfg.journal_path)
    with opened(cfg) as tier:
        assert tier.store.rebuilt_by == "scan" and tier.store.recovery.blocks == 8
        assert load(tier, list(range(8)), shards=2, slot_bytes=SLOT).all()
        assert tier.stats().checksum_failures == 0


@pytest.mark.parametrize("old", ["blake3", "blake2b"])
def test_old_records_load_beside_new_ones(tmp_path: Path, old: str) -> None:
    """Files written with the old default (blake3, or blake2b where blake3 was
    not installed; the same bytes on disk as that code wrote) load with the
    new one; new records are xxh3, and both survive a restart by scan."""
    with opened(config(tmp_path, checksum=old)) as tier:
        spill(tier, [1, 2], slot_bytes=SLOT)
    with opened(config(tmp_path)) as tier:
        assert tier.store.recovery.blocks == 2 and not tier.store.recovery.reinitialised
        assert load(tier, [1, 2], slot_bytes=SLOT).all()
        spill(tier, [3], slot_bytes=SLOT)
        assert _ids(tier) == {gds_format.CHECKSUM_IDS[old], 3}
    os.unlink(config(tmp_path).journal_path)
    with opened(config(tmp_path)) as tier:
        assert tier.store.recovery.blocks == 3
        assert load(tier, [1, 2, 3], slot_bytes=SLOT).all()
        assert tier.stats().checksum_failures == 0


def test_blake3_asked_for_but_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gds_format, "_has_blake3", lambda: False)
    with pytest.raises(SsdError, match="blake3 module is not installed"):
        SsdTier(config(tmp_path, checksum="blake3"))
    with pytest.raises(ValueError, match="ssd_checksum: 'md5'"):
        config(tmp_path, checksum="md5")


def test_flipped_payload_caught_by_xxh3(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, [1, 2, 3], slot_bytes=SLOT)
        rec = tier.store.index.get(NS, key(2))
        assert rec is not None and rec.checksum_id == 3
    with open(cfg.paths[0], "r+b") as f:  # one bit of block 2's payload
        f.seek(rec.offset + HEADER_BYTES + 4321)
        byte = f.read(1)[0]
        f.seek(rec.offset + HEADER_BYTES + 4321)
        f.write(bytes([byte ^ 0x01]))
    with opened(cfg) as tier:
        assert load(tier, [1, 2, 3], slot_bytes=SLOT).tolist() == [True, False, True]
        assert tier.stats().checksum_failures == 1
    os.unlink(cfg.journal_path)
    with opened(cfg) as tier:  # the scan hashes payloads too
        assert tier.lookup(NS, [key(1), key(2)]) == 1 and tier.lookup(NS, [key(3)])


def _write_future_records(
    cfg: SsdConfig, monkeypatch: pytest.MonkeyPatch, drop_journal: bool
) -> None:
    """Records as a newer server would write them: an id unknown here."""
    with monkeypatch.context() as m:
        m.setattr(gds_store, "checksum_id", lambda name: FUTURE_ID)
        m.setitem(gds_format._HASHERS, FUTURE_ID, hasher(3))
        m.setitem(gds_format._PART_HASHERS, FUTURE_ID, gds_format._xxh3_parts)
        with opened(cfg) as tier:
            spill(tier, [1, 2], slot_bytes=SLOT)
            assert _ids(tier) == {FUTURE_ID}
    if drop_journal:
        os.unlink(cfg.journal_path)


@pytest.mark.parametrize("drop_journal", [False, True], ids=["journal", "scan"])
def test_unknown_checksum_refused_or_reinitialised(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    drop_journal: bool,
) -> None:
    cfg = config(tmp_path)
    _write_future_records(cfg, monkeypatch, drop_journal)
    refuse = config(tmp_path, on_mismatch="refuse")
    with pytest.raises(SsdError, match=f"checksum id.s. {FUTURE_ID}, .*reinit"):
        SsdTier(refuse)
    assert os.path.exists(cfg.journal_path) != drop_journal  # refusing: untouched
    with caplog.at_level(logging.WARNING), opened(cfg) as tier:
        why = tier.store.recovery.reinitialised
        assert f"checksum id(s) {FUTURE_ID}" in why
        assert tier.store.recovery.blocks == 0 and not load(tier, [1, 2]).any()
        spill(tier, [3], slot_bytes=SLOT)
    assert "reinitialising (records name checksum id(s)" in caplog.text
    with opened(refuse) as tier:  # started afresh: fine now, even when refusing
        assert not tier.store.recovery.reinitialised
        assert load(tier, [3], slot_bytes=SLOT).all() and _ids(tier) == {3}


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "staged"])
def test_a_read_piece_hashes_in_one_call_and_fails_only_the_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    """Scenario: 24 blocks of 2 TP shards read back in one load, two of them
    with a flipped payload bit (one in the first shard, one in the second).
    The readers hash each read piece's records in one compiled call
    (pegaflow.common.checksum_rows, no GIL turn per record), every record exactly
    once; exactly the two damaged blocks fail, counted, and every other one
    lands byte-equal, whether read straight into page-aligned slots or staged
    and copied out (slots 16 B past a page, as a malloc'd buffer's)."""
    shards, slot, n = 2, 16384, 24
    cfg = config(tmp_path, read_threads=2)
    with opened(cfg) as tier:
        spill(tier, list(range(n)), shards=shards, slot_bytes=slot, aligned=True)
        damaged = {5: HEADER_BYTES + 100, 17: HEADER_BYTES + slot + 9000}
        spots = {
            i: tier.store.index.get(NS, key(i)).offset + at for i, at in damaged.items()
        }
    with open(cfg.paths[0], "r+b") as f:
        for pos in spots.values():
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ 0x01]))
    hashed: list[int] = []
    real = checksum_rows.rows

    def counted(addrs: np.ndarray, lengths: int | np.ndarray) -> np.ndarray:
        hashed.append(len(addrs))
        return real(addrs, lengths)

    monkeypatch.setattr(checksum_rows, "rows", counted)
    room = page_aligned(np.zeros(n * shards * slot + 4096, np.uint8))
    skew = 0 if in_place else 16
    dst = room[skew : skew + n * shards * slot].reshape(n, shards, slot)
    table = np.array([addresses(d) for d in dst], np.uint64)
    with opened(cfg) as tier:
        res = tier.load(NS, [key(i) for i in range(n)], table, slot).result(timeout=30)
        assert [i for i in range(n) if not res.ok[i]] == sorted(damaged)
        assert tier.stats().checksum_failures == 2
    for i in range(n):
        if i not in damaged:
            assert np.array_equal(dst[i], block(i, shards, slot)), f"block {i}"
    assert sum(hashed) == n and 1 <= len(hashed) <= 4, hashed
