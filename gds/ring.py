"""Bookkeeping of the SSD tier: records, each file's space as a FIFO ring, and the
index from (namespace digest, block hash) to the live record.

Pure Python, no I/O; the same code runs live and when the journal is replayed, so a
restarted server rebuilds exactly the ring it had. Callers hold the store's lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum

from pegaflow.common.keys import BlockHash

NsDigest = bytes
MAX_CHANGES = 1 << 18  # hashes an Index records for watchers between two takes


class State(IntEnum):
    WRITING = 0  # space claimed, bytes not yet (completely) on disk
    LIVE = 1  # written and indexed
    DEAD = 2  # evicted, failed or never committed; its space is reusable


@dataclass(slots=True, eq=False)
class Record:
    file: int
    offset: int
    length: int  # bytes on disk: header page + payload padded to 4 KiB
    seq: int
    ns_digest: NsDigest = b""
    block_hash: BlockHash = b""
    payload_len: int = 0
    checksum: int = 0
    checksum_id: int = 0
    state: State = State.WRITING
    readers: int = 0  # reads in flight: the space must not be overwritten

    @property
    def busy(self) -> bool:
        return self.state == State.WRITING or self.readers > 0


class Ring:
    """One file's record area [start, end) written front to back and wrapped.

    `records` holds every record whose space has not been reclaimed, oldest first,
    which is ring order: the oldest records lie just ahead of the head, so claiming
    space at the head reclaims from the front of the deque.
    """

    def __init__(self, file: int, start: int, end: int) -> None:
        self.file = file
        self.start = start
        self.end = end
        self.head = start
        self.records: deque[Record] = deque()

    def place(self, length: int) -> int | None:
        """Where a record of `length` bytes goes next (None: larger than the ring)."""
        if length > self.end - self.start:
            return None
        return self.head if self.head + length <= self.end else self.start

    def victims(self, offset: int, length: int) -> list[Record]:
        """Records whose space claiming [offset, offset + length) reclaims."""
        wrap = offset < self.head
        stop = offset + length
        out: list[Record] = []
        for rec in self.records:
            # the tail a wrap skips, or what the new record covers
            if (wrap and rec.offset >= self.head) or offset <= rec.offset < stop:
                out.append(rec)
            else:
                break
        return out

    def claim(self, offset: int, length: int, rec: Record) -> list[Record]:
        """Reclaim the victims (returned, marked dead) and append rec, which
        lies at offset for length bytes: claim_run of one record."""
        if (rec.offset, rec.length) != (offset, length):
            where = f"{rec.offset}+{rec.length}, not {offset}+{length}"
            raise ValueError(f"record at {where}")
        return self.claim_run([rec])

    def claim_run(self, run: list[Record]) -> list[Record]:
        """Reclaim the victims of the span that records laid back to back from
        run[0].offset on take (returned in ring order, marked dead) and append
        the records: one scan for the whole run."""
        start, last = run[0].offset, run[-1]
        victims = self.victims(start, last.offset + last.length - start)
        for _ in victims:
            self.records.popleft().state = State.DEAD
        self.records.extend(run)
        self.head = last.offset + last.length
        return victims

    @property
    def used_bytes(self) -> int:
        return sum(r.length for r in self.records if r.state != State.DEAD)


class Index:
    """(namespace digest, block hash) -> live record, one table per namespace so a
    prefix lookup is one C-level map() over the hashes."""

    def __init__(self) -> None:
        self.tables: dict[NsDigest, dict[BlockHash, Record]] = {}
        self.count = 0
        self.payload_bytes = 0
        # While someone watches (pegaflow.server.block_events): runs of
        # (stored?, namespace, hashes) since the last take_changes, in order,
        # at most MAX_CHANGES hashes (past that: dropped, `overflowed`).
        self.changes: list[tuple[bool, NsDigest, list[BlockHash]]] | None = None
        self.changed = 0
        self.overflowed = False

    def _note(self, stored: bool, ns: NsDigest, hashes: list[BlockHash]) -> None:
        if self.changes is None or self.overflowed:
            return
        if self.changed + len(hashes) > MAX_CHANGES:
            self.changes.clear()
            self.changed = 0
            self.overflowed = True
            return
        last = self.changes[-1] if self.changes else None
        if last is not None and last[0] == stored and last[1] == ns:
            last[2].extend(hashes)
        else:
            self.changes.append((stored, ns, list(hashes)))
        self.changed += len(hashes)

    def track(self, on: bool) -> None:
        """Record changes from now on (a fresh record), or stop."""
        self.changes = [] if on else None
        self.changed = 0
        self.overflowed = False

    def take_changes(self) -> tuple[list[tuple[bool, NsDigest, list[BlockHash]]], bool]:
        """The changes recorded since the last call, and whether some were
        lost (the record passed MAX_CHANGES); recording goes on afresh."""
        if self.changes is None:
            return [], False
        got, lost = self.changes, self.overflowed
        self.track(True)
        return got, lost

    def get(self, ns: NsDigest, block_hash: BlockHash) -> Record | None:
        return self.tables.get(ns, {}).get(block_hash)

    def put(self, rec: Record) -> None:
        table = self.tables.setdefault(rec.ns_digest, {})
        old = table.get(rec.block_hash)
        if old is not None:  # a newer copy of the same block wins
            old.state = State.DEAD
            self._forget(old)
        table[rec.block_hash] = rec
        self.count += 1
        self.payload_bytes += rec.payload_len
        self._note(True, rec.ns_digest, [rec.block_hash])

    def put_run(self, run: list[Record]) -> None:
        """put() of each record; one C-level update when they share a
        namespace and none replaces an indexed copy (the usual run)."""
        ns = run[0].ns_digest if run else b""
        table = self.tables.get(ns, {})
        keys = [r.block_hash for r in run]
        if (
            all(r.ns_digest == ns for r in run)
            and table.keys().isdisjoint(keys)
            and len(set(keys)) == len(keys)
        ):
            self.tables.setdefault(ns, table).update(zip(keys, run, strict=True))
            self.count += len(run)
            self.payload_bytes += sum(r.payload_len for r in run)
            self._note(True, ns, keys)
            return
        for rec in run:
            self.put(rec)

    def remove(self, rec: Record) -> bool:
        """Drop rec if it is the indexed copy of its key."""
        table = self.tables.get(rec.ns_digest)
        if table is None or table.get(rec.block_hash) is not rec:
            return False
        del table[rec.block_hash]
        if not table:
            del self.tables[rec.ns_digest]
        self._forget(rec)
        self._note(False, rec.ns_digest, [rec.block_hash])
        return True

    def _forget(self, rec: Record) -> None:
        self.count -= 1
        self.payload_bytes -= rec.payload_len

    def prefix(self, ns: NsDigest, hashes: list[BlockHash]) -> list[Record]:
        """Records of the longest prefix of hashes that is on SSD."""
        table = self.tables.get(ns)
        if table is None:
            return []
        found = list(map(table.get, hashes))
        if None in found:
            del found[found.index(None) :]
        return found  # type: ignore[return-value]  # no None left
