"""Append-only index journal of the SSD tier, so a restart rebuilds the index
without reading the data files.

Fixed-size entries, each with its own CRC-32: RESERVE (space claimed at the ring's
head, written before the data), COMMIT (the record is completely on disk, written
after it), DROP (a record found bad or failed to write) and HEAD (a ring's head,
in snapshots). Replaying them through the same ring code reproduces the index; a
RESERVE without its COMMIT is a write the crash tore, and its space is dropped. A
torn or corrupt entry ends the replay: everything before it stands.

The journal is rewritten as a snapshot of the live records (written beside it,
then renamed over it) whenever it grows past a few times the live set, and at a
start that found a torn tail, so its size stays bounded.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from tqdm import tqdm

from .format import MAX_HASH_BYTES, STORE_ID_BYTES, crc_rows
from .ring import Index, Record, Ring, State

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


def head_entry(ring: Ring) -> bytes:
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
    files (another store id or version)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
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


class Journal:
    """The open journal: appends are single write() calls (whole entries), so a
    process crash leaves at most one torn entry at the tail."""

    def __init__(self, path: str, fd: int, entries: int) -> None:
        self.path = path
        self.fd = fd
        self.entries = entries

    @classmethod
    def rewrite(cls, path: str, store_id: bytes, snapshot: Iterable[bytes]) -> Journal:
        """Write a fresh journal holding `snapshot` beside `path`, then rename it
        over `path`, so a crash leaves either the old journal or the new one."""
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        count = 0
        chunk: list[bytes] = [_header(store_id)]
        for item in snapshot:
            chunk.append(item)
            count += 1
            if len(chunk) >= 8192:
                os.write(fd, b"".join(chunk))
                chunk.clear()
        os.write(fd, b"".join(chunk))
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return cls(path, fd, count)

    @classmethod
    def reopen(cls, path: str, entries: int) -> Journal:
        """Append to a journal that replayed whole (no torn tail to cut off)."""
        return cls(
            path, os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC), entries
        )

    def append(self, data: bytes) -> None:
        os.write(self.fd, data)
        self.entries += len(data) // ENTRY_BYTES

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1


def snapshot(rings: list[Ring]) -> Iterable[bytes]:
    """Entries that rebuild the rings as they are: every record not dead, oldest
    first per ring (RESERVE, then COMMIT when written), then each ring's head."""
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
        if file >= len(rings):
            logger.warning("ssd journal: entry %d names file %d; stopping", i, file)
            break
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
