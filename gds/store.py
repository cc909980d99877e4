"""The SSD store: data files, rings, index and journal behind one lock.

Bookkeeping (reserve, commit, pin, drop) runs under `lock` and never does data
I/O; reading and writing record bytes (`write_run`, `read_run`) run outside it on the
caller's thread, against a record the bookkeeping keeps safe: a record being
written or read is busy, and the ring never reclaims busy space.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pegaflow.gds import journal, scan
from pegaflow.gds.config import SsdConfig
from pegaflow.gds.files import prepare
from pegaflow.gds.format import (
    ALIGN,
    HEADER_BYTES,
    SUPERBLOCK_BYTES,
    FormatError,
    RecordHeader,
    checksum_id,
    hash_parts,
    record_bytes,
)
from pegaflow.gds.io import AlignedBuffer, Part, SsdError, host_view, open_backend
from pegaflow.gds.ring import BlockHash, Index, NsDigest, Record, Ring, State

logger = logging.getLogger(__name__)

_ZERO_PAGE = bytes(HEADER_BYTES)

RebuiltBy = Literal["new", "journal", "scan"]
# More journal entries than this cut off before the end is damage, not a crash
# mid-append (which tears at most the last entry): scan the headers instead.
DAMAGED_JOURNAL_ENTRIES = 2


@dataclass(slots=True)
class StoreCounters:
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_read: int = 0
    write_errors: int = 0
    read_errors: int = 0
    checksum_failures: int = 0  # payload does not hash to its checksum
    header_mismatches: int = 0  # header damaged, or names another block / seq
    no_space: int = 0  # spills refused: every ring's next space is busy / too small


@dataclass(frozen=True, slots=True)
class Recovery:
    blocks: int
    # writes a crash interrupted (journal), or records found torn, damaged or
    # overwritten (scan): dropped
    torn_records: int
    torn_entries: int  # journal entries cut off or corrupt at the tail: dropped
    seconds: float
    reinitialised: str  # why the files were (re)initialised, "" when reused
    rebuilt_by: RebuiltBy  # "new": fresh files, nothing to rebuild


class SsdStore:
    def __init__(self, cfg: SsdConfig) -> None:
        try:
            self._checksum_id = checksum_id(cfg.checksum)
        except ValueError as exc:
            raise SsdError(f"--ssd-checksum: {exc}") from None
        start = time.perf_counter()
        self.cfg = cfg
        self.lock = threading.Lock()
        self.counters = StoreCounters()
        layout = prepare(cfg)
        self._lock_fd = layout.lock_fd
        self.store_id = layout.store_id
        self.rings = [
            Ring(i, SUPERBLOCK_BYTES, layout.file_bytes) for i in range(len(cfg.paths))
        ]
        self.index = Index()
        self._claimed = [0] * len(self.rings)  # bytes reserved per ring
        self._next_seq = 1
        try:
            self.io = open_backend(
                cfg.backend,
                cfg.paths,
                cfg.direct_io,
                cfg.write_threads + cfg.read_threads,
            )
            try:
                torn, torn_entries = self._recover(layout.fresh)
            except BaseException:
                self.io.close()
                raise
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._last_sync = time.monotonic()
        self.recovery = Recovery(
            self.index.count,
            torn,
            torn_entries,
            time.perf_counter() - start,
            layout.reason,
            self.rebuilt_by,
        )
        logger.info(
            "ssd cache ready: %d file(s), %.2f GiB, %s, %d block(s) recovered "
            "(%s) in %.2f s (%d torn write(s), %d torn journal entr(ies) dropped)",
            len(cfg.paths),
            layout.file_bytes * len(cfg.paths) / (1 << 30),
            self.io.mode,
            self.recovery.blocks,
            self.rebuilt_by,
            self.recovery.seconds,
            torn,
            torn_entries,
        )

    def _recover(self, fresh: bool) -> tuple[int, int]:
        """Rebuild the rings and index from the journal, or by scanning the record
        headers where the journal is missing, foreign, unreadable or damaged
        before its tail; then reopen the journal or rewrite it as a snapshot.
        Returns (torn or damaged records, torn journal entries)."""
        cfg = self.cfg
        self.rebuilt_by: RebuiltBy = "new"
        if fresh:
            loaded = None
        else:
            try:
                loaded = journal.load(cfg.journal_path, self.store_id)
            except OSError as exc:
                logger.warning("ssd journal %s unreadable: %s", cfg.journal_path, exc)
                loaded = None
        torn = torn_entries = 0
        if loaded is not None:
            torn_entries = loaded.torn
            if torn_entries > DAMAGED_JOURNAL_ENTRIES:
                logger.warning(
                    "ssd journal %s: damaged %d entries before its end",
                    cfg.journal_path,
                    torn_entries,
                )
                loaded = None
        if loaded is not None:
            done = journal.replay(
                loaded.entries, self.rings, self.index, cfg.show_progress
            )
            torn, self._next_seq = done.torn_records, max(1, done.next_seq)
            self.rebuilt_by = "journal"
        elif not fresh:
            logger.warning(
                "ssd cache: no usable journal at %s; rebuilding the index by "
                "scanning %.2f GiB of record headers",
                cfg.journal_path,
                self.capacity_bytes / (1 << 30),
            )
            found = scan.scan(
                self.io,
                self.rings,
                self.index,
                self.store_id,
                cfg.read_threads,
                cfg.show_progress,
            )
            torn, self._next_seq = found.dropped, max(1, found.next_seq)
            self.rebuilt_by = "scan"
        if (
            loaded is not None
            and not loaded.torn
            and not self._journal_bloated(len(loaded.entries))
        ):
            self.journal = journal.Journal.reopen(cfg.journal_path, len(loaded.entries))
        else:
            self.journal = journal.Journal.rewrite(
                cfg.journal_path, self.store_id, journal.snapshot(self.rings)
            )
        return torn, torn_entries

    # -- writing -----------------------------------------------------------------------
    def reserve(
        self, ns: NsDigest, block_hash: BlockHash, payload: int
    ) -> Record | None:
        """Claim space for one record (see reserve_run); None when there is none."""
        run = self.reserve_run([(ns, block_hash, payload)])
        return run[0] if run else None

    def reserve_run(
        self, blocks: list[tuple[NsDigest, BlockHash, int]]
    ) -> list[Record]:
        """Claim back-to-back space in one ring for the longest prefix of blocks
        (namespace, hash, payload bytes) that fits at some ring's head without
        wrapping, so the run goes to disk in one write.
        Empty when not even the first block fits: larger than a file, or every
        next space busy."""
        lengths = [record_bytes(payload) for _, _, payload in blocks]
        with self.lock:
            placed = self._place(lengths)
            if placed is None:
                self.counters.no_space += 1
                return []
            ring, offset, count = placed
            run = []
            for (ns, block_hash, payload), length in zip(
                blocks[:count], lengths, strict=False
            ):
                rec = Record(ring.file, offset, length, self._next_seq, ns)
                rec.block_hash, rec.payload_len = block_hash, payload
                rec.checksum_id = self._checksum_id
                self._next_seq += 1
                for victim in ring.claim(offset, length, rec):
                    self.index.remove(victim)
                run.append(rec)
                offset += length
            self.journal.append(
                b"".join(journal.entry(journal.Kind.RESERVE, r) for r in run)
            )
            self._claimed[ring.file] += offset - run[0].offset
            return run

    def _place(self, lengths: list[int]) -> tuple[Ring, int, int] | None:
        """(ring, offset, how many blocks): the ring that took the fewest bytes
        so far (runs differ in size; files fill evenly) whose head takes a prefix
        of the records without reclaiming busy ones. The run stops at the ring's
        end rather than wrapping early, so no space is skipped."""
        ends = list(itertools.accumulate(lengths))
        for ring in sorted(self.rings, key=lambda r: self._claimed[r.file]):
            offset = ring.place(lengths[0])
            if offset is None:
                continue
            count = bisect.bisect_right(ends, ring.end - offset)
            while count:
                if not any(v.busy for v in ring.victims(offset, ends[count - 1])):
                    return ring, offset, count
                count //= 2
        return None

    def write_run(
        self,
        run: list[Record],
        payloads: Sequence[Sequence[Part]],
        buf: AlignedBuffer,
        on_copied: Callable[[], None] | None = None,
    ) -> bool:
        """Write a run of reserved, back-to-back records in one request and
        commit it; False when the write failed (the run is dropped, counted).
        Outside the lock.

        payloads[i] is record i's payload as (address, bytes) parts laid back
        to back: its TP-shard slots. A record whose parts are all 4 KiB-aligned
        in address and length is written straight from them (a gather write:
        no copy); any other is copied into buf first, with its padding zeroed.
        Header pages are built in buf. `on_copied` is called exactly once, as
        soon as no payload byte is needed any more (after the copies when every
        record is staged, after the write otherwise) and before the commit;
        if it raises, the run is dropped and the exception propagates."""
        pending = [on_copied]

        def copied() -> None:
            fn, pending[0] = pending[0], None
            if fn is not None:
                fn()

        try:
            iov, in_place = self._gather(run, payloads, buf)
            if not in_place:
                copied()  # all staged: the slots are free before the write
            try:
                self.io.pwritev(run[0].file, iov, run[0].offset)
            except OSError as exc:
                logger.warning(
                    "ssd write of %d B failed: %s",
                    run[-1].offset + run[-1].length - run[0].offset,
                    exc,
                )
                for rec in run:
                    self._drop(rec, "write_errors")
                return False
            copied()
        except BaseException:
            for rec in run:
                self.abort(rec)  # never leave its space busy
            raise
        finally:
            copied()  # a failure before the write: the slots are the caller's
        with self.lock:
            for rec in run:
                rec.state = State.LIVE
                self.index.put(rec)
                self.counters.bytes_written += rec.payload_len
            self.counters.blocks_written += len(run)
            self.journal.append(
                b"".join(journal.entry(journal.Kind.COMMIT, r) for r in run)
            )
            self._maybe_compact()
        self._maybe_sync()
        return True

    def _gather(
        self,
        run: list[Record],
        payloads: Sequence[Sequence[Part]],
        buf: AlignedBuffer,
    ) -> tuple[list[Part], bool]:
        """Checksum each payload, build its header page in buf, stage the
        payloads that cannot be written in place. Returns the run's parts in
        file order (contiguous ones merged) and whether any payload is written
        in place."""
        direct = [
            all(a % ALIGN == 0 and n % ALIGN == 0 for a, n in parts)
            for parts in payloads
        ]
        buf.ensure(
            sum(
                HEADER_BYTES if d else rec.length
                for rec, d in zip(run, direct, strict=True)
            )
        )
        iov: list[Part] = []
        at = 0
        for rec, parts, d in zip(run, payloads, direct, strict=True):
            if sum(n for _, n in parts) != rec.payload_len:
                raise ValueError(f"payload of {rec.payload_len} B given in other parts")
            head = buf.address + at
            if d:
                views = [host_view(a, n) for a, n in parts]
                iov.append((head, HEADER_BYTES))
                iov.extend(parts)
                at += HEADER_BYTES
            else:
                dst = head + HEADER_BYTES
                for a, n in parts:
                    ctypes.memmove(dst, a, n)
                    dst += n
                ctypes.memset(dst, 0, rec.length - HEADER_BYTES - rec.payload_len)
                start = at + HEADER_BYTES
                views = [buf.view(start, start + rec.payload_len)]
                iov.append((head, rec.length))
                at += rec.length
            rec.checksum = hash_parts(rec.checksum_id, views)
            page = buf.view(head - buf.address, head - buf.address + HEADER_BYTES)
            page[:] = _ZERO_PAGE  # no stale bytes from the last run
            RecordHeader(
                rec.ns_digest,
                rec.block_hash,
                self.store_id,
                rec.seq,
                rec.payload_len,
                rec.checksum,
                rec.checksum_id,
            ).pack_into(page)
        merged: list[Part] = [iov[0]]
        for a, n in iov[1:]:
            last_a, last_n = merged[-1]
            if last_a + last_n == a:
                merged[-1] = (last_a, last_n + n)
            else:
                merged.append((a, n))
        return merged, any(direct)

    def abort(self, rec: Record) -> None:
        """Give up a record still being written (an error before its commit)."""
        if rec.state == State.WRITING:
            self._drop(rec, "write_errors")

    def _drop(self, rec: Record, counter: str) -> None:
        with self.lock:
            self.index.remove(rec)
            rec.state = State.DEAD
            self.journal.append(journal.entry(journal.Kind.DROP, rec))
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)

    def _journal_bloated(self, entries: int) -> bool:
        live = sum(len(r.records) for r in self.rings)
        return entries > self.cfg.journal_slack * max(live, 4096) + 64

    def _maybe_compact(self) -> None:
        if not self._journal_bloated(self.journal.entries):
            return
        old = self.journal
        try:
            self.journal = journal.Journal.rewrite(
                old.path, self.store_id, journal.snapshot(self.rings)
            )
        except OSError as exc:  # keep appending to the old one
            logger.warning("ssd journal snapshot failed: %s", exc)
            return
        old.close()

    def _maybe_sync(self) -> None:
        now = time.monotonic()
        if now - self._last_sync < self.cfg.sync_interval_s:
            return
        self._last_sync = now
        try:
            self.io.sync()
            with self.lock:
                self.journal.sync()
        except OSError as exc:
            logger.warning("ssd cache sync failed: %s", exc)

    # -- reading -----------------------------------------------------------------------
    def pin(self, ns: NsDigest, block_hash: BlockHash) -> Record | None:
        with self.lock:
            rec = self.index.get(ns, block_hash)
            if rec is not None:
                rec.readers += 1
            return rec

    def unpin(self, recs: list[Record]) -> None:
        with self.lock:
            for rec in recs:
                rec.readers -= 1

    def read_run(
        self,
        run: list[Record],
        dests: Sequence[Sequence[int]],
        each: int,
        buf: AlignedBuffer,
    ) -> list[bool]:
        """Read pinned records that lie back to back in one file in one request,
        verify each, and unpin them; ok per record. Outside the lock.

        dests[i] is record i's slot address per TP shard, `each` bytes apiece.
        A record whose slots are all 4 KiB-aligned in address and length is read
        straight into them (a scatter read: header page into buf, payload into
        the slots, no copy) and its checksum taken over the slots in place; any
        other is read into buf, verified there and copied out. A record that
        does not match (header, checksum) or a run whose read fails is False
        and dropped (counted); its slots may then hold partial or damaged
        bytes, which the caller must not use. A record of other geometry than
        the caller's is False and kept (not the record's fault)."""
        ok = [False] * len(run)
        failures: list[tuple[Record, str]] = []
        try:
            # the records that fit the caller's geometry, in pieces of
            # back-to-back ones: one request per piece
            piece: list[int] = []
            for i, rec in enumerate([*run, None]):
                if piece and (
                    rec is None
                    or rec.file != run[piece[-1]].file
                    or rec.offset != run[piece[-1]].offset + run[piece[-1]].length
                    or rec.payload_len != len(dests[i]) * each
                ):
                    got = self._read_piece(
                        [run[j] for j in piece],
                        [dests[j] for j in piece],
                        each,
                        buf,
                        failures,
                    )
                    for j, good in zip(piece, got, strict=True):
                        ok[j] = good
                    piece = []
                if rec is not None and rec.payload_len == len(dests[i]) * each:
                    piece.append(i)
        finally:
            with self.lock:
                for i, rec in enumerate(run):
                    rec.readers -= 1
                    if ok[i]:
                        self.counters.bytes_read += rec.payload_len
                        self.counters.blocks_read += 1
        for rec, failure in failures:
            logger.warning("ssd record %s: %s, dropped", rec.block_hash.hex(), failure)
            self._drop(rec, failure)
        return ok

    def _read_piece(
        self,
        recs: list[Record],
        dests: Sequence[Sequence[int]],
        each: int,
        buf: AlignedBuffer,
        failures: list[tuple[Record, str]],
    ) -> list[bool]:
        direct = each % ALIGN == 0
        in_place = [direct and all(a % ALIGN == 0 for a in d) for d in dests]
        buf.ensure(
            sum(
                HEADER_BYTES if p else rec.length
                for rec, p in zip(recs, in_place, strict=True)
            )
        )
        iov: list[Part] = []
        where: list[int] = []  # each record's header page (or whole record) in buf
        at = 0
        for rec, d, p in zip(recs, dests, in_place, strict=True):
            where.append(at)
            if p:
                iov.append((buf.address + at, HEADER_BYTES))
                iov.extend((a, each) for a in d)
                at += HEADER_BYTES
            else:
                iov.append((buf.address + at, rec.length))
                at += rec.length
        merged: list[Part] = [iov[0]]
        for a, n in iov[1:]:
            last_a, last_n = merged[-1]
            if last_a + last_n == a:
                merged[-1] = (last_a, last_n + n)
            else:
                merged.append((a, n))
        try:
            self.io.preadv(recs[0].file, merged, recs[0].offset)
        except OSError as exc:
            logger.warning(
                "ssd read of %d B failed: %s",
                recs[-1].offset + recs[-1].length - recs[0].offset,
                exc,
            )
            failures.extend((rec, "read_errors") for rec in recs)
            return [False] * len(recs)
        ok = []
        for rec, d, p, head in zip(recs, dests, in_place, where, strict=True):
            if p:
                payload = [host_view(a, each) for a in d]
            else:
                lo = head + HEADER_BYTES
                payload = [buf.view(lo, lo + rec.payload_len)]
            failure = self._verify(rec, buf.view(head, head + HEADER_BYTES), payload)
            if failure:
                failures.append((rec, failure))
                ok.append(False)
                continue
            if not p:
                src = buf.address + head + HEADER_BYTES
                for i, dest in enumerate(d):
                    ctypes.memmove(dest, src + i * each, each)
            ok.append(True)
        return ok

    def _verify(self, rec: Record, page: memoryview, payload: list[memoryview]) -> str:
        """The counter to bump, or "" when the record is intact and the one
        indexed: its header page, then the payload's parts (back to back)."""
        try:
            head = RecordHeader.unpack(page)
        except FormatError:
            return "header_mismatches"
        expect = (self.store_id, rec.seq, rec.ns_digest, rec.block_hash)
        got = (head.store_id, head.seq, head.ns_digest, head.block_hash)
        if got != expect or head.payload_len != rec.payload_len:
            return "header_mismatches"
        if head.checksum != rec.checksum or head.checksum_id != rec.checksum_id:
            return "header_mismatches"
        try:
            if hash_parts(head.checksum_id, payload) != head.checksum:
                return "checksum_failures"
        except (FormatError, ImportError):
            return "checksum_failures"
        return ""

    # -- life cycle --------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return sum(r.end - r.start for r in self.rings)

    @property
    def stored_bytes(self) -> int:
        """Payload bytes of the indexed blocks (headers and padding not counted)."""
        return self.index.payload_bytes

    def close(self) -> None:
        with self.lock:
            if self.journal.fd < 0:
                return
            self.io.sync()
            self.journal.close()
            self.io.close()
            os.close(self._lock_fd)
