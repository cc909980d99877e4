"""The journal's snapshot (its rewrite when it has grown): written and synced
outside the store's lock, which every save and load takes, with the appends
made meanwhile carried into it; and created beside the journal under a name
of its own that nothing planted there can take or block."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

import pytest

from pegaflow.gds import journal
from pegaflow.gds.io import AlignedBuffer
from pegaflow.gds.ring import Ring
from pegaflow.gds.store import SsdStore
from tests.gds.helpers import NS, addresses, block, config, key, load, opened, spill

SLOT = 8192


def _write_one(store: SsdStore, i: int) -> None:
    """Block i written through the store itself (reserve, write, commit)."""
    data = block(i, 1, SLOT)
    run = store.reserve_run([(NS, key(i), SLOT)])
    buf = AlignedBuffer()
    try:
        assert store.write_run(run, [[(addresses(data)[0], SLOT)]], buf)
    finally:
        buf.close()


def test_snapshot_is_written_outside_the_lock_and_keeps_appends_made_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the snapshot was written and fsynced under store.lock,
    stalling every save and load for seconds at millions of records. While
    it is written now, the lock is free: a DROP and a whole write made then
    (appended to the old journal) are in the new one after a restart."""
    cfg = config(tmp_path, capacity=4 << 20, write_threads=1)
    real_snapshot, real_fsync = journal.snapshot, os.fsync
    free: list[bool] = []
    fsync_locked: list[bool] = []
    with opened(cfg) as tier:
        store = tier.store
        spill(tier, [0, 1, 2], slot_bytes=SLOT)

        def snapshot(rings: list[Ring]) -> Iterable[bytes]:
            got = store.lock.acquire(blocking=False)  # never waits: no deadlock
            free.append(got)
            if got:
                store.lock.release()
                rec = store.index.get(NS, key(0))
                assert rec is not None
                store.drop_damaged(rec, "checksum_failures")
                _write_one(store, 9)
            yield from real_snapshot(rings)

        def fsync(fd: int) -> None:
            fsync_locked.append(store.lock.locked())
            real_fsync(fd)

        monkeypatch.setattr(journal, "snapshot", snapshot)
        monkeypatch.setattr(os, "fsync", fsync)
        store.journal.entries = 100_000  # bloated: the next commit snapshots
        spill(tier, [3], slot_bytes=SLOT)
        monkeypatch.undo()
        assert free == [True]
        assert fsync_locked and not any(fsync_locked)
        assert store.journal.entries < 100  # rewritten
        assert tier.stats().journal_errors == 0
    with opened(cfg) as tier:
        rec = tier.store.recovery
        assert (rec.rebuilt_by, rec.torn_records, rec.blocks) == ("journal", 0, 4)
        assert tier.lookup(NS, [key(0)]) == 0
        assert load(tier, [1, 2, 3, 9], slot_bytes=SLOT).all()


def test_snapshot_file_has_a_random_private_name_nothing_planted_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the snapshot was written to <journal>.tmp, a name another
    user of a shared sticky folder can take first with an entry we cannot
    remove (here: a folder), failing every rewrite and so the start. Now it
    is a new 0600 file of a random name; our own leftovers of a crash are
    removed at the start, links and others' entries left alone."""
    cfg = config(tmp_path)
    planted = Path(f"{cfg.journal_path}.tmp")
    planted.mkdir()
    (planted / "x").write_bytes(b"")
    ours = Path(f"{cfg.journal_path}.0123456789abcdef.tmp")
    ours.write_bytes(b"left by a crash")
    link = Path(f"{cfg.journal_path}.fedcba9876543210.tmp")
    link.symlink_to(tmp_path / "elsewhere")
    real_snapshot = journal.snapshot
    drafts: list[tuple[str, int]] = []

    def snapshot(rings: list[Ring]) -> Iterable[bytes]:
        for p in tmp_path.glob("*.tmp"):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                drafts.append((p.name, stat.S_IMODE(st.st_mode)))
        yield from real_snapshot(rings)

    monkeypatch.setattr(journal, "snapshot", snapshot)
    with opened(cfg) as tier:  # a fresh start writes the journal's snapshot
        spill(tier, [1])
    with opened(cfg) as tier:  # a snapshot of a bloated journal
        tier.store.journal.entries = 100_000
        spill(tier, [2])
    name = re.escape(Path(cfg.journal_path).name)
    assert len(drafts) == 2, drafts
    assert all(re.fullmatch(name + r"\.[0-9a-f]{16}\.tmp", n) for n, _ in drafts)
    assert drafts[0][0] != drafts[1][0]
    assert all(mode == 0o600 for _, mode in drafts)
    assert not ours.exists() and link.is_symlink() and planted.is_dir()
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == sorted(
        [planted.name, link.name]
    )
    with opened(cfg) as tier:
        assert tier.store.recovery.rebuilt_by == "journal"
        assert load(tier, [1, 2]).all()
