"""The journal's filesystem failing (full, I/O errors, short writes): spills
keep going once it recovers, no ring space stays busy, a failed snapshot
leaves no file or descriptor behind and is not retried after every write."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from pegaflow.gds import journal
from pegaflow.gds.ring import Ring
from pegaflow.gds.store import SsdStore
from tests.gds.helpers import NS, addresses, block, config, key, load, opened, spill

SLOT = 8192  # 12 KiB records: a 2 MiB ring wraps after ~170


def _full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def _failing(
    real: Callable[[bytes], None], fails: Callable[[bytes], bool]
) -> Callable[[bytes], None]:
    """Journal.append that raises ENOSPC for the data `fails` picks."""

    def append(data: bytes) -> None:
        if fails(data):
            raise _full()
        real(data)

    return append


def _first_call() -> Callable[[bytes], bool]:
    calls = iter([True])
    return lambda _data: next(calls, False)


def _open_fds(folder: Path) -> int:
    """This process's descriptors of files in `folder`, deleted ones too: not
    all of them (other tests' threads may open and close sockets meanwhile)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{folder}/")
    return count


def test_failed_reserve_append_leaves_no_space_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RESERVE append fails once: that spill is refused, and the spills
    after it wrap the ring more than once without a single "no space"."""
    with opened(config(tmp_path, capacity=2 << 20, write_threads=1)) as tier:
        store = tier.store
        once = _failing(store.journal.append, _first_call())
        monkeypatch.setattr(store.journal, "append", once)
        spill(tier, [0], slot_bytes=SLOT)
        assert tier.lookup(NS, [key(0)]) == 0
        spill(tier, list(range(1, 400)), slot_bytes=SLOT)
        st = tier.stats()
        assert st.no_space == 0 and st.blocks_written == 399
        assert load(tier, list(range(390, 400)), slot_bytes=SLOT).all()
        assert st.journal_errors == 1 and st.write_errors == 0


def test_failed_drop_appends_free_the_whole_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of 4 records whose write fails while the journal refuses every
    DROP: all 4 are freed (not only the first), later spills wrap past them."""
    with opened(config(tmp_path, capacity=2 << 20, write_threads=1)) as tier:
        store = tier.store
        drop = journal.Kind.DROP
        no_drops = _failing(store.journal.append, lambda d: d[0] == drop)
        monkeypatch.setattr(store.journal, "append", no_drops)
        real_write, first = store.io.pwritev, _first_call()

        def write_fails_once(file: int, parts: object, offset: int) -> None:
            if first(b""):
                raise OSError(errno.EIO, "Input/output error")
            real_write(file, parts, offset)  # type: ignore[arg-type]

        monkeypatch.setattr(store.io, "pwritev", write_fails_once)
        held = [np.ascontiguousarray(block(i, 1, SLOT)) for i in range(4)]
        table = np.array([addresses(h) for h in held], np.uint64)
        hashes = [key(i) for i in range(4)]
        assert tier.spill_many(NS, hashes, table, SLOT) == list(range(4))
        assert tier.flush(timeout=30)
        assert tier.lookup(NS, hashes) == 0
        spill(tier, list(range(4, 400)), slot_bytes=SLOT)
        st = tier.stats()
        assert st.no_space == 0 and st.blocks_written == 396
        assert load(tier, list(range(390, 400)), slot_bytes=SLOT).all()
        assert st.write_errors == 4
        assert st.journal_errors == 1  # one DROP append for the run


def test_failed_snapshot_closes_its_file_and_backs_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal is past its snapshot size and the snapshot fails: the
    temporary file and its descriptor are gone, and it is tried again only
    once the journal has grown by another snapshot threshold."""
    cfg = config(tmp_path, capacity=4 << 20, write_threads=1)
    folder = Path(cfg.journal_path).parent
    attempts: list[int] = []
    real_snapshot = journal.snapshot

    def full_disk(rings: list[Ring]) -> Iterator[bytes]:
        attempts.append(len(rings))
        yield journal.head_entry(rings[0])
        raise _full()

    with opened(cfg) as tier:
        store: SsdStore = tier.store
        spill(tier, [0], slot_bytes=SLOT)
        monkeypatch.setattr(journal, "snapshot", full_disk)
        fds = _open_fds(folder)
        assert fds  # the journal's own
        store.journal.entries = 100_000  # bloated: every commit checks it
        for i in range(1, 6):  # five runs, five commits
            spill(tier, [i], slot_bytes=SLOT)
        assert attempts == [1]
        assert not list(folder.glob("*.tmp"))
        assert _open_fds(folder) == fds
        assert tier.stats().journal_errors == 1
        monkeypatch.setattr(journal, "snapshot", real_snapshot)
        store.journal.entries += 100_000  # grown by as much again
        spill(tier, [6], slot_bytes=SLOT)
        assert store.journal.entries < 100  # rewritten: the snapshot of 7
    with opened(cfg) as tier:
        rec = tier.store.recovery
        assert (rec.rebuilt_by, rec.blocks) == ("journal", 7)
        assert load(tier, list(range(7)), slot_bytes=SLOT).all()


def test_short_journal_writes_keep_entries_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write comes back short (100 bytes of a 136-byte entry): the
    journal still holds whole entries and replays every block."""
    cfg = config(tmp_path)
    real_write = os.write

    def short(fd: int, data: bytes) -> int:
        return real_write(fd, memoryview(data)[:100])

    monkeypatch.setattr(os, "write", short)
    with opened(cfg) as tier:
        spill(tier, list(range(20)), slot_bytes=SLOT)
    monkeypatch.setattr(os, "write", real_write)
    with opened(cfg) as tier:
        rec = tier.store.recovery
        assert (rec.rebuilt_by, rec.torn_entries, rec.blocks) == ("journal", 0, 20)
        assert load(tier, list(range(20)), slot_bytes=SLOT).all()


def test_failed_append_is_cut_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append that wrote part of its entries before failing leaves none
    of them: the next append starts on an entry boundary."""
    path = str(tmp_path / "j")
    log = journal.Journal.rewrite(path, b"s" * 16, [])
    size = os.path.getsize(path)
    real_write, first = os.write, _first_call()

    def part_then_full(fd: int, data: bytes) -> int:
        if first(b""):
            return real_write(fd, memoryview(data)[:50])
        raise _full()

    monkeypatch.setattr(os, "write", part_then_full)
    with pytest.raises(OSError):
        log.append(b"x" * journal.ENTRY_BYTES)
    monkeypatch.setattr(os, "write", real_write)
    assert os.path.getsize(path) == size == log.size
    log.close()
