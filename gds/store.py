"""The SSD store: data files, rings, index and journal behind one lock.

Bookkeeping (reserve, commit, pin, drop) runs under `lock` and never does data
I/O; reading and writing record bytes (`write_run`, `read_run`) run outside it on the
caller's thread, against a record the bookkeeping keeps safe: a record being
written or read is busy, and the ring never reclaims busy space.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import journal
from .config import SsdConfig
from .files import Layout, Mismatch, prepare, reinitialise
from .format import MAX_PAYLOAD_BYTES, SUPERBLOCK_BYTES, checksum_id, record_bytes
from .io import AlignedBuffer, SsdError, open_backend
from .records import Payloads, gather, read_pieces
from .recovery import Recovered, Recovery, journal_limit, log_ready, recover
from .ring import BlockHash, Index, NsDigest, Record, Ring, State

logger = logging.getLogger(__name__)

__all__ = ["Recovery", "SsdStore", "SsdStoreCounters"]

_MAX_RECORD_BYTES = record_bytes(MAX_PAYLOAD_BYTES)
# A snapshot's writer catches up with the appends made meanwhile outside the
# lock, at most this many times, until fewer than this many bytes came.
_CATCH_UP_ROUNDS = 8
_CATCH_UP_BYTES = 64 * journal.ENTRY_BYTES


@dataclass(slots=True)
class SsdStoreCounters:
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_read: int = 0
    write_errors: int = 0
    read_errors: int = 0
    checksum_failures: int = 0  # payload does not hash to its checksum
    header_mismatches: int = 0  # header damaged, or names another block / seq
    no_space: int = 0  # spills refused: every ring's next space is busy / too small
    # journal writes that failed (spill refused, or a restart may drop the block)
    journal_errors: int = 0


class SsdStore:
    def __init__(self, cfg: SsdConfig) -> None:
        try:
            self._checksum_id = checksum_id(cfg.checksum)
        except ValueError as exc:
            raise SsdError(f"ssd_checksum: {exc}") from None
        start = time.perf_counter()
        self.cfg = cfg
        self.lock = threading.Lock()
        self.counters = SsdStoreCounters()
        layout = prepare(cfg)
        self._locks = layout.fds  # flock'ed: one server per cache file
        try:
            self.io = open_backend(
                cfg.backend,
                cfg.paths,
                cfg.direct_io,
                cfg.write_threads + cfg.read_threads,
                layout.fds,
            )
            try:
                layout, done = self._recover(layout)
            except BaseException:
                self.io.close()
                raise
        except BaseException:
            for fd in self._locks:
                os.close(fd)
            raise
        self.journal = done.journal
        self._compact_at = 0  # journal entries before the next snapshot try
        self._compacting = False  # a writer is writing a snapshot (_compact)
        self._next_seq = done.next_seq
        self.rebuilt_by = done.rebuilt_by
        self._last_sync = time.monotonic()
        self.recovery = Recovery(
            self.index.count,
            done.torn_records,
            done.torn_entries,
            time.perf_counter() - start,
            layout.reason,
            done.rebuilt_by,
            done.unreadable_bytes,
        )
        log_ready(self.recovery, len(cfg.paths), layout.file_bytes, self.io.mode)

    def _recover(self, layout: Layout) -> tuple[Layout, Recovered]:
        """Rebuild rings and index from the files; files that recovery finds
        unfit (records of an unknown checksum) are refused or started afresh."""
        try:
            return layout, self._rebuild(layout)
        except Mismatch as exc:
            layout = reinitialise(self.cfg, layout.fds, str(exc))
            return layout, self._rebuild(layout)

    def _rebuild(self, layout: Layout) -> Recovered:
        self.store_id = layout.store_id
        self.rings = [
            Ring(i, SUPERBLOCK_BYTES, layout.file_bytes)
            for i in range(len(self.cfg.paths))
        ]
        self.index = Index()
        self._claimed = [0] * len(self.rings)  # bytes reserved per ring
        args = (self.cfg, self.io, self.rings, self.index, self.store_id)
        return recover(*args, layout.fresh)

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
        Empty when not even the first block fits (larger than a file or
        MAX_PAYLOAD_BYTES, or every next space busy) or the journal refused the
        RESERVE entries; the ring is then as before."""
        lengths = [record_bytes(payload) for _, _, payload in blocks]
        if max(lengths, default=0) > _MAX_RECORD_BYTES:
            lengths = list(
                itertools.takewhile(lambda n: n <= _MAX_RECORD_BYTES, lengths)
            )
        with self.lock:
            placed = self._place(lengths) if lengths else None
            if placed is None:  # the caller drops them all: count each
                self.counters.no_space += len(blocks)
                return []
            ring, offset, count = placed
            run = []
            for (ns, block_hash, payload), length in zip(
                blocks[:count], lengths, strict=False
            ):
                run.append(
                    Record(
                        ring.file,
                        offset,
                        length,
                        self._next_seq,
                        ns,
                        block_hash,
                        payload,
                        checksum_id=self._checksum_id,
                    )
                )
                self._next_seq += 1
                offset += length
            # Journal first: a failed append then leaves nothing claimed, and
            # no record stuck "being written" that the ring could never reclaim.
            try:
                self.journal.append(journal.entries(journal.Kind.RESERVE, run))
            except OSError as exc:
                self._journal_failed("reserving space (spill refused)", exc)
                return []
            for victim in ring.claim_run(run):
                self.index.remove(victim)
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
        payloads: Payloads,
        buf: AlignedBuffer,
        on_copied: Callable[[], None] | None = None,
    ) -> bool:
        """Write a run of reserved, back-to-back records in one request and
        commit it; False when the write failed (the run is dropped, counted).
        Outside the lock.

        payloads: a SlotTable of the run's slot rows (or payloads[i], record
        i's payload as (address, bytes) parts laid back to back: its TP-shard
        slots). A record whose parts are all 4 KiB-aligned in address and
        length is written straight from them (a gather write:
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
            iov, in_place = gather(run, payloads, buf, self.store_id)
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
                self._drop(run, "write_errors")
                return False
            copied()
        except BaseException:
            # never leave its space busy
            self._drop([r for r in run if r.state == State.WRITING], "write_errors")
            raise
        finally:
            copied()  # a failure before the write: the slots are the caller's
        with self.lock:
            for rec in run:
                rec.state = State.LIVE
            self.index.put_run(run)
            self.counters.bytes_written += sum(r.payload_len for r in run)
            self.counters.blocks_written += len(run)
            try:
                self.journal.append(journal.entries(journal.Kind.COMMIT, run))
            except OSError as exc:  # on disk and served; a restart finds it torn
                self._journal_failed("committing a write", exc)
            frozen = self._compact_due()
        if frozen is not None:
            self._compact(frozen)
        self._maybe_sync()
        return True

    def abort(self, rec: Record) -> None:
        """Give up a record still being written (an error before its commit)."""
        if rec.state == State.WRITING:
            self._drop([rec], "write_errors")

    def drop_damaged(self, rec: Record, failure: str) -> None:
        """A record a reader found damaged (`failure`: verify's counter)."""
        logger.warning("ssd record %s: %s, dropped", rec.block_hash.hex(), failure)
        self._drop([rec], failure)

    def _drop(self, recs: list[Record], counter: str) -> None:
        """Forget records and free their space, then journal it: best effort,
        since a restart without the DROP finds each record torn (no COMMIT) or
        damaged (checksum) and drops it then."""
        if not recs:
            return
        with self.lock:
            for rec in recs:
                self.index.remove(rec)
                rec.state = State.DEAD
            setattr(self.counters, counter, getattr(self.counters, counter) + len(recs))
            try:
                self.journal.append(journal.entries(journal.Kind.DROP, recs))
            except OSError as exc:
                self._journal_failed("dropping records", exc)

    def _journal_failed(self, what: str, exc: OSError) -> None:
        self.counters.journal_errors += 1
        logger.warning("ssd journal %s: %s failed: %s", self.journal.path, what, exc)

    def _compact_due(self) -> list[journal.Frozen] | None:
        """Under the lock: the rings as they are, when the journal is due a
        snapshot and none is being written; the journal then carries a copy
        of every append from here on (see _compact)."""
        if self._compacting or self.journal.entries < self._compact_at:
            return None
        if self.journal.entries <= journal_limit(self.cfg, self.rings):
            return None
        self._compacting = True
        self.journal.carry = []
        return journal.freeze(self.rings)

    def _compact(self, frozen: list[journal.Frozen]) -> None:
        """Rewrite the journal as a snapshot of `frozen` plus what was
        appended since, on the caller's thread. The snapshot (millions of
        entries at a large cache: seconds) is written and synced outside the
        lock, which every save and load takes; so are the appends carried
        meanwhile, but for the last few, written under the lock just before
        the new journal is renamed over the old one."""
        old = self.journal
        draft = None
        try:
            draft = journal.Draft(old.path)
            draft.write_snapshot(self.store_id, journal.snapshot(frozen))
            for _ in range(_CATCH_UP_ROUNDS):
                with self.lock:
                    data = old.take_carried()
                draft.write(data)
                if len(data) < _CATCH_UP_BYTES:
                    break
            os.fsync(draft.fd)
            with self.lock:
                if self.journal is not old or old.fd < 0:  # closed meanwhile
                    old.carry = None
                    draft.discard()
                    return
                draft.write(old.take_carried())
                os.fdatasync(draft.fd)  # only what came since the fsync
                self.journal = draft.install()
                old.carry = None
                self._compact_at = 0
        except OSError as exc:
            if draft is not None:
                draft.discard()
            with self.lock:
                old.carry = None
                # Keep appending to the old one. A retry after every run would
                # write a whole snapshot each time the disk says no: wait until
                # the journal has grown by as much again.
                self._compact_at = old.entries + journal_limit(self.cfg, self.rings)
                self._journal_failed("snapshot", exc)
            return
        except BaseException:
            if draft is not None:
                draft.discard()
            with self.lock:
                old.carry = None
            raise
        finally:
            with self.lock:
                self._compacting = False
        journal.sync_dir(old.path)
        try:
            old.close()
        except OSError as exc:  # replaced already: nothing of it is needed
            logger.warning("ssd journal: closing the replaced one failed: %s", exc)

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
            read_pieces(self.io, self.store_id, run, dests, each, buf, ok, failures)
        finally:
            with self.lock:
                for i, rec in enumerate(run):
                    rec.readers -= 1
                    if ok[i]:
                        self.counters.bytes_read += rec.payload_len
                        self.counters.blocks_read += 1
        for rec, failure in failures:
            self.drop_damaged(rec, failure)
        return ok

    # -- life cycle --------------------------------------------------------------------
    @property
    def checked_fds(self) -> tuple[int, ...]:
        """The data files' descriptors files.py checked and locked, open until
        close(): what a reader opening them again goes through (reopen_path)."""
        return tuple(self._locks)

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
            for fd in self._locks:
                os.close(fd)
