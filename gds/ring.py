"""Bookkeeping of the SSD tier: records, each file's space as a FIFO ring, and the
index from (namespace digest, block hash) to the live record.

Pure Python, no I/O; the same code runs live and when the journal is replayed, so a
restarted server rebuilds exactly the ring it had. Callers hold the store's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from itertools import islice

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


# Records per chunk of a Records queue: a frozen view costs one tuple per
# chunk (~31 000, a few ms, at 8M records). Small: the chunk being filled is
# a young list the garbage collector walks at every collection of its
# generation (4096 cost a journal replay ~25 % more, 256 about 4 %).
CHUNK = 256
# A frozen view of a Records queue: (chunk, first, stop) ranges, oldest first.
RecordsView = tuple[tuple[list[Record], int, int], ...]


class Records:
    """A FIFO of records (append and extend at the back, drop_front), kept in
    chunks of CHUNK that are only ever appended to: a dropped record moves an
    index, a chunk emptied that way leaves the queue whole. So `view()`
    names the records of this moment in O(chunks), and what it names never
    changes after, whatever the queue does: a snapshot is read from it
    outside the store's lock (journal.freeze)."""

    __slots__ = ("_chunks", "_first", "_len")

    def __init__(self, records: Iterable[Record] = ()) -> None:
        self._chunks: deque[list[Record]] = deque()
        self._first = 0  # index of the oldest record in _chunks[0]
        self._len = 0
        self.extend(records)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Record]:
        """Oldest first (the queue must not change while this is used)."""
        first = self._first
        for chunk in self._chunks:
            it = iter(chunk)
            it.__setstate__(first)  # type: ignore[attr-defined]
            first = 0
            yield from it

    def __getitem__(self, i: int) -> Record:
        """The i-th oldest (0) or the newest (-1) record, as a deque's."""
        if i == -1 and self._len:
            return self._chunks[-1][-1]
        if 0 <= i < self._len:
            return next(islice(iter(self), i, None))
        raise IndexError(i)

    def extend(self, records: Iterable[Record]) -> None:
        items = records if isinstance(records, list) else list(records)
        chunks = self._chunks
        if chunks and len(chunks[-1]) + len(items) <= CHUNK:  # the usual run
            chunks[-1].extend(items)
            self._len += len(items)
            return
        at = 0
        while at < len(items):
            if not chunks or len(chunks[-1]) >= CHUNK:
                chunks.append([])
            last = chunks[-1]
            take = items[at : at + CHUNK - len(last)]
            last.extend(take)
            at += len(take)
        self._len += len(items)

    def append(self, rec: Record) -> None:
        self.extend((rec,))

    def drop_front(self, n: int) -> None:
        """Forget the n oldest records."""
        if n > self._len:
            raise IndexError(f"drop {n} of {self._len}")
        if not n:
            return
        self._len -= n
        if self._first + n < len(self._chunks[0]):  # within the first chunk
            self._first += n
            return
        while n:
            first = self._chunks[0]
            step = min(n, len(first) - self._first)
            self._first += step
            n -= step
            if self._first == len(first):  # its slots are never reused
                self._chunks.popleft()
                self._first = 0

    def popleft(self) -> Record:
        rec = self[0]
        self.drop_front(1)
        return rec

    def view(self) -> RecordsView:
        """The records of this moment, as ranges of chunks that no later
        change to the queue alters."""
        out = []
        for i, chunk in enumerate(self._chunks):
            first = self._first if i == 0 else 0
            if first < len(chunk):
                out.append((chunk, first, len(chunk)))
        return tuple(out)


def walk(view: RecordsView) -> Iterator[Record]:
    """The records of a view, oldest first."""
    for chunk, first, stop in view:
        yield from map(chunk.__getitem__, range(first, stop))


class Ring:
    """One file's record area [start, end) written front to back and wrapped.

    `records` holds every record whose space has not been reclaimed, oldest first,
    which is ring order: the oldest records lie just ahead of the head, so claiming
    space at the head reclaims from the front of the queue.
    """

    def __init__(self, file: int, start: int, end: int) -> None:
        self.file = file
        self.start = start
        self.end = end
        self.head = start
        self.records = Records()

    def place(self, length: int) -> int | None:
        """Where a record of `length` bytes goes next (None: larger than the ring)."""
        if length > self.end - self.start:
            return None
        return self.head if self.head + length <= self.end else self.start

    def victims(self, offset: int, length: int) -> list[Record]:
        """Records whose space claiming [offset, offset + length) reclaims."""
        head = self.head
        wrap = offset < head
        stop = offset + length
        out: list[Record] = []
        recs = self.records
        first, chunks = recs._first, recs._chunks  # Records' own (this module)
        for chunk in chunks:  # plain list iterators: claims are hot (replay)
            it = iter(chunk)
            if first:  # the first chunk's dropped records: skipped in O(1)
                it.__setstate__(first)  # type: ignore[attr-defined]
                first = 0
            for rec in it:
                # the tail a wrap skips, or what the new record covers
                if (wrap and rec.offset >= head) or offset <= rec.offset < stop:
                    out.append(rec)
                else:
                    return out
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
        recs = self.records
        if victims:  # the front of the queue, in order
            for rec in victims:
                rec.state = State.DEAD
            n = len(victims)
            if recs._first + n < len(recs._chunks[0]):  # drop_front, inline:
                recs._first += n  # claims are hot (replay makes one a record)
                recs._len -= n
            else:
                recs.drop_front(n)
        chunks = recs._chunks
        if chunks and len(chunks[-1]) + len(run) <= CHUNK:  # extend, inline
            chunks[-1].extend(run)
            recs._len += len(run)
        else:
            recs.extend(run)
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
