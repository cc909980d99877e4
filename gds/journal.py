"""Append-only index journal of the SSD tier, so a restart rebuilds the index
without reading the data files.

Fixed-size entries, each with its own CRC-32: RESERVE (space claimed at the ring's
head, written before the data), COMMIT (the record is completely on disk, written
after it), DROP (a record found bad or failed to write) and HEAD (a ring's head,
in snapshots). Replaying them through the same ring code reproduces the index; a
RESERVE without its COMMIT is a write the crash tore, and its space is dropped. A
torn or corrupt entry ends the replay: everything before it stands. An intact
entry whose fields this store cannot have written (`first_invalid`: space
outside the record area, off the grid, a length not its payload's) makes the
whole journal untrusted, and the start rebuilds the index by a header scan.

The journal is rewritten as a snapshot of the live records (written beside it,
then renamed over it) whenever it grows past a few times the live set, and at a
start that found a torn tail, so its size stays bounded. A running store writes
that snapshot outside its lock and carries the appends made meanwhile into it
(store.SsdStore._compact). The journal is a private file (private.py); the one
a rewrite creates beside it is a new 0600 file of a random name (Draft), never
opened through a link.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from tqdm import tqdm

from .format import (
    ALIGN,
    HEADER_BYTES,
    MAX_HASH_BYTES,
    MAX_PAYLOAD_BYTES,
    STORE_ID_BYTES,
    crc_rows,
)
from .private import check_private, open_private
from .ring import Index, Record, RecordsView, Ring, State, walk

logger = logging.getLogger(__name__)

JOURNAL_MAGIC = b"PGFLJRN\x00"
JOURNAL_VERSION = 1
PROGRESS_MIN_ENTRIES = 100_000


class Kind(IntEnum):
    RESERVE = 1
    COMMIT = 2
    DROP = 3
    HEAD = 4


# kind, checksum id, hash length, file, offset, length, seq, payload length,
# checksum, namespace digest, block hash; then CRC-32 of those 128 bytes + pad.
_BODY = struct.Struct("<BBBxIQQQQQ16s64s")
_TAIL = struct.Struct("<II")
ENTRY_BYTES = _BODY.size + _TAIL.size
_DTYPE = np.dtype(
    [
        ("kind", "u1"),
        ("checksum_id", "u1"),
        ("hash_len", "u1"),
        ("pad", "u1"),
        ("file", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("seq", "<u8"),
        ("payload_len", "<u8"),
        ("checksum", "<u8"),
        ("ns", "V16"),
        ("hash", f"V{MAX_HASH_BYTES}"),
        ("crc", "<u4"),
        ("pad2", "<u4"),
    ]
)
assert _DTYPE.itemsize == ENTRY_BYTES == 136
_HEAD = struct.Struct(f"<8sI{STORE_ID_BYTES}s")  # magic, version, store id


# An entry as body and tail, for entries() to set a run's CRCs at once.
_ROW = np.dtype([("body", f"V{_BODY.size}"), ("crc", "<u4"), ("pad", "<u4")])


def entry(kind: Kind, rec: Record) -> bytes:
    body = _BODY.pack(
        kind,
        rec.checksum_id,
        len(rec.block_hash),
        rec.file,
        rec.offset,
        rec.length,
        rec.seq,
        rec.payload_len,
        rec.checksum,
        rec.ns_digest,
        rec.block_hash,
    )
    return body + _TAIL.pack(zlib.crc32(body), 0)


def entries(kind: Kind, run: list[Record]) -> bytes:
    """entry() of every record of a run, back to back: a struct.pack and a
    zlib.crc32 per record mapped over the run, the CRCs set in with one
    numpy assignment (about half the time of entry() per record; the
    writers' Python time per block is taken from the save path's threads)."""
    bodies = [
        _BODY.pack(
            kind,
            r.checksum_id,
            len(r.block_hash),
            r.file,
            r.offset,
            r.length,
            r.seq,
            r.payload_len,
            r.checksum,
            r.ns_digest,
            r.block_hash,
        )
        for r in run
    ]
    return crc_rows(bodies, _ROW).tobytes()


def head_entry(ring: Ring | Frozen) -> bytes:
    return entry(Kind.HEAD, Record(ring.file, ring.head, 0, 0))


def _header(store_id: bytes) -> bytes:
    raw = _HEAD.pack(JOURNAL_MAGIC, JOURNAL_VERSION, store_id)
    return raw.ljust(ENTRY_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class Loaded:
    entries: np.ndarray  # the intact prefix
    torn: int  # entries (or a partial one) dropped at the tail


def load(path: str, store_id: bytes) -> Loaded | None:
    """The journal's intact entries; None when it is missing or belongs to other
    files (another store id or version). Raises SsdError for a journal that is
    not a private file of this server's user."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        check_private(fd, path)
        raw = f.read()
    if raw[:ENTRY_BYTES] != _header(store_id):
        return None
    body = memoryview(raw)[ENTRY_BYTES:]
    whole = len(body) // ENTRY_BYTES
    entries = np.frombuffer(body[: whole * ENTRY_BYTES], _DTYPE)
    crcs = entries["crc"].tolist()
    good = whole
    step = ENTRY_BYTES
    for i in range(whole):
        if zlib.crc32(body[i * step : i * step + _BODY.size]) != crcs[i]:
            good = i
            break
    torn = whole - good + (1 if len(body) % ENTRY_BYTES else 0)
    return Loaded(entries[:good], torn)


def first_invalid(entries: np.ndarray, rings: list[Ring]) -> tuple[int, str] | None:
    """(index, why) of the first entry this store cannot have written, or None.

    A CRC only proves an entry is whole; its fields are checked here, all
    entries at once, before a replay trusts them: a record entry must lie in
    its ring's record area on the 4 KiB grid and be exactly as long as its
    payload's record; a HEAD must lie in the area. Else one entry could point
    the next write at the superblock or past the file's end."""
    if not entries.size:
        return None
    kind = entries["kind"]
    file = entries["file"].astype(np.int64)
    offset, length = entries["offset"], entries["length"]
    plen, hlen = entries["payload_len"], entries["hash_len"]
    known = file < len(rings)
    at = np.where(known, file, 0)
    start = np.array([r.start for r in rings], np.uint64)[at]
    end = np.array([r.end for r in rings], np.uint64)[at]
    record = np.isin(kind, (Kind.RESERVE, Kind.COMMIT, Kind.DROP))
    fits = plen <= MAX_PAYLOAD_BYTES
    padded = np.where(fits, plen, 0) + (ALIGN - 1)
    expected = HEADER_BYTES + padded // ALIGN * ALIGN
    inside = (offset >= start) & (offset <= end)
    rules = (
        (~(record | (kind == Kind.HEAD)), "an unknown kind"),
        (~known, f"a file past the {len(rings)} configured"),
        (offset % ALIGN != 0, "an offset off the 4 KiB grid"),
        (~inside, "an offset outside the record area"),
        (record & ~fits, f"a payload over {MAX_PAYLOAD_BYTES} bytes"),
        (record & (length != expected), "a length other than its payload's record"),
        (record & inside & (length > end - offset), "a record past the file's end"),
        (record & ((hlen == 0) | (hlen > MAX_HASH_BYTES)), "a bad hash length"),
    )
    worst: tuple[int, str] | None = None
    for mask, why in rules:
        hits = np.flatnonzero(mask)
        if hits.size and (worst is None or hits[0] < worst[0]):
            worst = int(hits[0]), why
    return worst


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until all of data is down: a write may come back short (a
    signal, a nearly full disk), and a partial entry misaligns all after it."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, f"journal write stopped at {n}")
        view = view[n:]


def _write_snapshot(
    fd: int, store_id: bytes, snapshot: Iterable[bytes]
) -> tuple[int, int]:
    """Write the header and the snapshot's entries, 8192 a write; returns
    (entries, bytes) written."""
    count = size = 0
    chunk: list[bytes] = [_header(store_id)]
    for item in snapshot:
        chunk.append(item)
        count += 1
        if len(chunk) >= 8192:
            size += _write_joined(fd, chunk)
    size += _write_joined(fd, chunk)
    return count, size


def _write_joined(fd: int, chunk: list[bytes]) -> int:
    data = b"".join(chunk)
    _write_all(fd, data)
    chunk.clear()
    return len(data)


def _sync_dir(path: str) -> None:
    """fsync the folder of path, so a rename into it survives a power loss."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_LEFTOVER = re.compile(r"\.(?:[0-9a-f]{16}\.)?tmp")


def _create_beside(path: str) -> tuple[str, int]:
    """A new file in path's folder, named at random: O_EXCL and O_NOFOLLOW,
    mode 0600. Nothing planted beside the journal (a link, or a file of
    another user in a shared sticky folder, which we could not remove) is
    opened, and no name another user can guess blocks the rewrite."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    for _ in range(8):
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"
        try:
            return tmp, os.open(tmp, flags | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"no free name beside {path} for its snapshot")


def remove_leftovers(path: str) -> None:
    """Remove the snapshots a crash mid-rewrite left beside the journal
    (`<path>.<random>.tmp`, or `<path>.tmp` of older versions): only regular
    files of this server's user, and only at a start (no rewrite runs)."""
    folder, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not (name.startswith(base) and _LEFTOVER.fullmatch(name, len(base))):
            continue
        full = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(full)  # a link or another user's file: left alone


class Draft:
    """A journal being written beside `path` in a file of its own (see
    _create_beside), to be renamed over it whole: a crash leaves either
    the old journal or the new one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tmp, self.fd = _create_beside(path)
        self.entries = 0
        self.size = 0

    def write_snapshot(self, store_id: bytes, snapshot: Iterable[bytes]) -> None:
        count, size = _write_snapshot(self.fd, store_id, snapshot)
        self.entries += count
        self.size += size

    def write(self, data: bytes) -> None:
        """Whole entries after the snapshot (appended to the old journal
        while it was written)."""
        _write_all(self.fd, data)
        self.size += len(data)
        self.entries += len(data) // ENTRY_BYTES

    def install(self) -> Journal:
        """Rename over the journal (the caller synced the file); the open
        Journal, this draft's descriptor."""
        os.replace(self.tmp, self.path)
        fd, self.fd = self.fd, -1
        return Journal(self.path, fd, self.entries, self.size)

    def discard(self) -> None:
        """Close and remove the file, unless it was installed."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def sync_dir(path: str) -> None:
    """_sync_dir after an install: a failure is only logged (the rename is
    done, the new journal is the one)."""
    try:
        _sync_dir(path)
    except OSError as exc:
        logger.warning("ssd journal %s: syncing its folder failed: %s", path, exc)


class Journal:
    """The open journal: appends are whole entries; a process crash leaves at
    most one torn entry at the tail, and a failed append is cut off again."""

    def __init__(self, path: str, fd: int, entries: int, size: int) -> None:
        self.path = path
        self.fd = fd
        self.entries = entries
        self.size = size  # bytes on disk: where a failed append is cut back to
        # While a snapshot is written beside it: a copy of every append since
        # the snapshot's moment, carried into the new journal before the swap.
        self.carry: list[bytes] | None = None

    @classmethod
    def rewrite(cls, path: str, store_id: bytes, snapshot: Iterable[bytes]) -> Journal:
        """Write a fresh journal holding `snapshot` beside `path`, then rename it
        over `path` (Draft), so a crash leaves either the old journal or the
        new one."""
        draft = Draft(path)
        try:
            draft.write_snapshot(store_id, snapshot)
            os.fsync(draft.fd)
            log = draft.install()
        except BaseException:
            draft.discard()
            raise
        sync_dir(path)
        return log

    @classmethod
    def reopen(cls, path: str, entries: int) -> Journal:
        """Append to a journal that replayed whole (no torn tail to cut off)."""
        fd = open_private(path, os.O_WRONLY | os.O_APPEND)
        try:
            check_private(fd, path)
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, entries, size)

    def append(self, data: bytes) -> None:
        """Write whole entries; on an OSError none of them stays (the next
        append starts on an entry boundary) and the error is raised."""
        try:
            _write_all(self.fd, data)
        except OSError:
            try:
                os.ftruncate(self.fd, self.size)
            except OSError as exc:  # the replay then ends at the partial entry
                logger.warning(
                    "ssd journal %s: cutting back failed: %s", self.path, exc
                )
            raise
        self.size += len(data)
        self.entries += len(data) // ENTRY_BYTES
        if self.carry is not None:
            self.carry.append(data)

    def take_carried(self) -> bytes:
        """The appends carried since the last take (call under the store's
        lock, as appends are)."""
        if not self.carry:
            return b""
        data = b"".join(self.carry)
        self.carry = []
        return data

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass(frozen=True, slots=True)
class Frozen:
    """A ring at one moment (taken under the store's lock): its records in
    order (the objects: their states are read later) and its head."""

    file: int
    view: RecordsView
    head: int

    @property
    def records(self) -> Iterator[Record]:
        return walk(self.view)


def freeze(rings: list[Ring]) -> list[Frozen]:
    """The rings as they are, in O(chunks of records) (Records.view): what
    a snapshot written outside the lock starts from."""
    return [Frozen(r.file, r.records.view(), r.head) for r in rings]


def snapshot(rings: Sequence[Ring | Frozen]) -> Iterable[bytes]:
    """Entries that rebuild the rings as they are: every record not dead, oldest
    first per ring (RESERVE, then COMMIT when written), then each ring's head.

    Of frozen rings, each record's state is read as it is now, which may be
    later than the moment they were frozen: a COMMIT or DROP (and a RESERVE
    that reclaimed it) made since was appended to the journal after that
    moment, and is carried after the snapshot, where replaying it again
    changes nothing (replay matches offset and seq)."""
    for ring in rings:
        for rec in ring.records:
            if rec.state != State.DEAD:
                yield entry(Kind.RESERVE, rec)
            if rec.state == State.LIVE:
                yield entry(Kind.COMMIT, rec)
        yield head_entry(ring)


@dataclass(frozen=True, slots=True)
class Replayed:
    live: int
    torn_records: int  # RESERVEs without their COMMIT
    next_seq: int


def replay(
    entries: np.ndarray, rings: list[Ring], index: Index, progress: bool
) -> Replayed:
    """Rebuild rings and index from entries that `first_invalid` passed."""
    n = len(entries)
    cols = [
        entries[name].tolist()
        for name in ("kind", "file", "offset", "length", "seq", "payload_len")
    ]
    cols += [entries[name].tolist() for name in ("checksum", "checksum_id")]
    ns, hashes, hlen = (entries[k].tolist() for k in ("ns", "hash", "hash_len"))
    pending: dict[tuple[int, int], Record] = {}
    next_seq = 0
    bar = tqdm(
        total=n,
        desc="rebuilding ssd index",
        unit="entry",
        disable=not progress or n < PROGRESS_MIN_ENTRIES,
    )
    for i, (kind, file, off, length, seq, plen, csum, algo) in enumerate(
        zip(*cols, strict=True)
    ):
        if i & 0x3FFF == 0:
            bar.update(min(0x4000, n - i))
        ring = rings[file]
        if kind == Kind.RESERVE:
            rec = Record(file, off, length, seq)
            for victim in ring.claim(off, length, rec):
                index.remove(victim)
                pending.pop((file, victim.offset), None)
            pending[(file, off)] = rec
            next_seq = max(next_seq, seq + 1)
        elif kind == Kind.COMMIT:
            rec = pending.pop((file, off), None)
            if rec is None or rec.seq != seq:
                continue
            rec.ns_digest, rec.block_hash = ns[i], hashes[i][: hlen[i]]
            rec.payload_len, rec.checksum, rec.checksum_id = plen, csum, algo
            rec.state = State.LIVE
            index.put(rec)
        elif kind == Kind.DROP:
            rec = pending.get((file, off))
            if rec is not None and rec.seq == seq:
                del pending[(file, off)]
            else:
                rec = index.get(ns[i], hashes[i][: hlen[i]])
            if rec is not None and rec.seq == seq:
                index.remove(rec)
                rec.state = State.DEAD
        elif kind == Kind.HEAD:
            ring.head = off
    bar.close()
    for rec in pending.values():
        rec.state = State.DEAD
    return Replayed(index.count, len(pending), next_seq)
