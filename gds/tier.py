"""SsdTier: the seam between the server and the SSD store.

Spills go through a bounded queue to writer threads; a full queue drops the spill
and counts it, so the caller (the event loop, evicting from L1) never waits.
Loads run on a reader pool and complete a concurrent.futures.Future. Lookups are
lock-free dictionary reads. Nothing here touches the asyncio loop.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from pegaflow.common import checksum_rows

from .config import SsdConfig
from .format import check_key
from .io import AlignedBuffer, warm_copies
from .ring import BlockHash, NsDigest, Record
from .spill_queue import Job, Slice, SliceRelease, SpillQueue, payloads_of
from .store import SsdStore

logger = logging.getLogger(__name__)

Release = Callable[[], None]
# A writer takes the spills queued behind its next one, up to these, and writes
# them back to back in one request: fewer, larger I/Os (dd-sized) and one
# journal append per run instead of one per block.
RUN_BYTES = 16 << 20
RUN_BLOCKS = 256
# A load reads up to this much of its blocks per request where their records lie
# back to back on disk (as a run of spills writes them).
READ_RUN_BYTES = 16 << 20
READ_RUN_BLOCKS = 256
_NONE: frozenset[BlockHash] = frozenset()


@dataclass(frozen=True, slots=True)
class SsdLoadResult:
    ok: np.ndarray  # bool per requested block: its bytes are in its slots
    nbytes: int  # payload bytes read into slots
    seconds: float  # from load() to the last block done (prefetch latency)


@dataclass(frozen=True, slots=True)
class SsdStats:
    """A snapshot for /metrics; counters only grow."""

    mode: str  # I/O backend in use, e.g. "posix-odirect", "kvikio-compat"
    capacity_bytes: int
    stored_bytes: int  # payload bytes of the blocks on SSD
    blocks: int
    queue_depth: int  # blocks queued or being written
    queue_capacity: int
    spills_queued: int
    spills_dropped: int  # queue full
    spills_skipped: int  # already on SSD or queued
    spills_not_admitted: int  # admission "seen_twice": first eviction
    bytes_written: int
    bytes_read: int
    blocks_written: int
    blocks_read: int
    no_space: int  # spills refused: no free (non-busy) space
    write_errors: int
    read_errors: int
    checksum_failures: int
    header_mismatches: int
    journal_errors: int  # failed journal writes: spill refused, or lost at restart
    loads: int
    load_blocks: int
    load_hits: int
    load_seconds: float  # total over loads: divide by loads for the mean


class SsdClosed(RuntimeError):
    """A load asked of a tier that is closing or closed (the server is
    stopping): nothing of it was read."""


class SsdTier:
    def __init__(self, config: SsdConfig) -> None:
        self.config = config
        self.store = SsdStore(config)
        self._lock = threading.Lock()  # queue, pending keys, ghost list, counters
        self._queue = SpillQueue(config.queue_blocks, self._lock)
        self._pending: dict[NsDigest, set[BlockHash]] = {}
        self._ghost: OrderedDict[tuple[NsDigest, BlockHash], None] = OrderedDict()
        self._counts = dict.fromkeys(
            ("queued", "dropped", "skipped", "not_admitted", "loads", "blocks", "hits"),
            0,
        )
        self._load_seconds = 0.0
        self._closed = False
        # Held by a load while it checks _closed and hands its reads to the
        # reader pool, and by close while it sets _closed: a load either sees
        # the tier closed or has all its reads queued before the pool shuts
        # down (which waits for them; then the files close). Not self._lock:
        # a read's completion takes that one, and may run on the loading
        # thread.
        self._loads_gate = threading.Lock()
        self._local = threading.local()
        # compiled now, not in a writer's first run
        checksum_rows.warm()
        warm_copies()
        self._writers = [
            threading.Thread(
                target=self._write_loop, name=f"ssd-write-{i}", daemon=True
            )
            for i in range(config.write_threads)
        ]
        for t in self._writers:
            t.start()
        self._readers = ThreadPoolExecutor(config.read_threads, "ssd-read")

    @property
    def mode(self) -> str:
        return self.store.io.mode

    # -- spill -------------------------------------------------------------------------
    def spill(
        self,
        ns_digest: NsDigest,
        block_hash: BlockHash,
        slots: Sequence[int] | np.ndarray,
        slot_bytes: int,
        release: Release | None = None,
    ) -> bool:
        """Queue a block for writing: the payload is the `slot_bytes` at each
        address in `slots` (one per TP shard), back to back. Never blocks.

        True: queued; `release` is then called exactly once, from a writer thread,
        as soon as the slots' bytes are no longer needed (written to disk, or
        copied out where the slots are not 4 KiB-aligned, or the spill
        failed): until then the caller keeps the slots from being reused. False:
        not queued (already on SSD or queued, not admitted, queue full, closed);
        `release` is not called and the slots are the caller's again at once."""
        table = np.asarray(slots, np.uint64).reshape(1, -1)
        done = None if release is None else (lambda lo, hi: release())
        return (
            len(self.spill_many(ns_digest, [block_hash], table, slot_bytes, done)) == 1
        )

    def spill_many(
        self,
        ns_digest: NsDigest,
        hashes: list[BlockHash],
        slots: np.ndarray,
        slot_bytes: int,
        release: SliceRelease | None = None,
    ) -> list[int]:
        """spill() of many blocks of one namespace at once (one lock round, one
        queue entry): slots[i] holds block i's addresses ([n, shards] uint64).
        Returns the indices queued, in order; the rest are not (as spill's
        False). `release(lo, hi)` is then called once per written slice, from a
        writer thread, with positions in that returned list: blocks
        queued[lo:hi] no longer need their slots. Blocks that do not fit the
        queue's room are dropped from the end and counted."""
        if hashes:  # every length checked by the shortest and the longest
            check_key(ns_digest, min(hashes, key=len))
            check_key(ns_digest, max(hashes, key=len))
        table = np.asarray(slots, np.uint64).reshape(len(hashes), -1)
        with self._lock:
            take = self._admit(ns_digest, hashes)
            room = self._queue.room()
            if len(take) > room:
                self._counts["dropped"] += len(take) - room
                del take[room:]
            if not take:
                return []
            if len(take) == len(hashes):
                job = Job(ns_digest, list(hashes), table, slot_bytes, release)
            else:
                picked = [hashes[i] for i in take]
                job = Job(ns_digest, picked, table[take], slot_bytes, release)
            self._pending.setdefault(ns_digest, set()).update(job.hashes)
            self._queue.put(job)
            self._counts["queued"] += len(take)
        return take

    def queue_room(self) -> int:
        """Blocks the queue could take now: a hint, read without the lock (the
        writers only make room). At 0 a caller skips building the slot table
        of a spill the queue would drop whole and calls refuse_many instead."""
        return self._queue.room()

    def refuse_many(self, ns_digest: NsDigest, hashes: list[BlockHash]) -> None:
        """Count hashes as spill_many does at a full queue (skipped if queued
        or on the SSD, not admitted, else dropped), queueing none. Under a save
        burst the disk cannot absorb, most spills end here: this costs two set
        checks, where a table of their slots would cost ~0.1 ms per 640."""
        with self._lock:
            self._counts["dropped"] += len(self._admit(ns_digest, hashes))

    def _admit(self, ns_digest: NsDigest, hashes: list[BlockHash]) -> list[int]:
        """Indices of hashes to queue, room aside: neither queued nor on the
        SSD, and admitted (under the lock; counts the skipped and the not
        admitted). Nothing once the tier is closed."""
        if self._closed:
            self._counts["skipped"] += len(hashes)
            return []
        take = self._fresh(ns_digest, hashes)
        if self.config.admission == "seen_twice":
            seen = [i for i in take if self._seen_before((ns_digest, hashes[i]))]
            self._counts["not_admitted"] += len(take) - len(seen)
            take = seen
        return take

    def _fresh(self, ns: NsDigest, hashes: list[BlockHash]) -> list[int]:
        """Indices of hashes neither queued nor on SSD (under the lock); the
        usual case (none is) costs two C-level set checks, not a loop."""
        pending = self._pending.get(ns, _NONE)
        on_ssd = self.store.index.tables.get(ns, {})
        if (
            pending.isdisjoint(hashes)
            and on_ssd.keys().isdisjoint(hashes)
            and len(set(hashes)) == len(hashes)
        ):
            return list(range(len(hashes)))
        out: list[int] = []
        seen: set[BlockHash] = set()
        for i, h in enumerate(hashes):
            if h in pending or h in on_ssd or h in seen:
                self._counts["skipped"] += 1
            else:
                seen.add(h)
                out.append(i)
        return out

    def _seen_before(self, key: tuple[NsDigest, BlockHash]) -> bool:
        if key in self._ghost:
            del self._ghost[key]
            return True
        self._ghost[key] = None
        if len(self._ghost) > self.config.ghost_keys:
            self._ghost.popitem(last=False)
        return False

    def _write_loop(self) -> None:
        buf = AlignedBuffer()
        try:
            while (slices := self._queue.take(RUN_BYTES, RUN_BLOCKS)) is not None:
                try:
                    self._write_batch(slices, buf)
                except Exception:  # a background loop: log, count, go on
                    logger.exception("ssd spill failed")
                finally:
                    with self._lock:
                        for sl in slices:
                            self._pending[sl.job.ns].difference_update(
                                sl.job.hashes[sl.lo : sl.hi]
                            )
                        self._queue.done(sum(sl.hi - sl.lo for sl in slices))
        finally:
            buf.close()

    def _write_batch(self, slices: list[Slice], buf: AlignedBuffer) -> None:
        """Reserve runs of back-to-back space for the slices' blocks (as much
        of them as one ring takes at a time) and write each run in one request:
        payloads straight from their slots where aligned, staged in buf
        otherwise. The slots are released once written (or copied), before the
        commit: one release call per slice and run, never one per block."""
        blocks = [
            (sl.job.ns, h, sl.job.block_bytes)
            for sl in slices
            for h in sl.job.hashes[sl.lo : sl.hi]
        ]
        payloads = payloads_of(slices)
        released = 0

        def release(upto: int) -> None:
            nonlocal released
            lo, released = released, upto
            _release_range(slices, lo, upto)

        try:
            while released < len(blocks):
                run = self.store.reserve_run(blocks[released:])
                if not run:
                    return  # counted as no_space; the finally releases the rest
                end = released + len(run)
                self.store.write_run(
                    run, payloads[released:end], buf, functools.partial(release, end)
                )
        finally:
            if released < len(blocks):
                _release_range(slices, released, len(blocks))

    # -- lookup and load ---------------------------------------------------------------
    def track_changes(self, on: bool) -> None:
        """Record which blocks become readable or are dropped (KV events for
        routers, pegaflow.server.block_events), or stop recording."""
        with self.store.lock:
            self.store.index.track(on)

    def take_changes(
        self,
    ) -> tuple[list[tuple[bool, NsDigest, list[BlockHash]]], bool]:
        """(stored?, namespace digest, hashes) runs in order since the last
        call, and whether some were lost (too many between two calls)."""
        with self.store.lock:
            return self.store.index.take_changes()

    def hashes(self, ns_digest: NsDigest) -> list[BlockHash]:
        """Every block of the namespace the SSD holds now."""
        with self.store.lock:
            return list(self.store.index.tables.get(ns_digest, ()))

    def lookup(self, ns_digest: NsDigest, hashes: list[BlockHash]) -> int:
        """How many of hashes, from the first, are on SSD. Lock-free: a block may
        still be evicted before it is loaded (load then reports it missing)."""
        return len(self.store.index.prefix(ns_digest, hashes))

    def load(
        self,
        ns_digest: NsDigest,
        hashes: Sequence[BlockHash],
        slots: np.ndarray,
        slot_bytes: int,
    ) -> Future[SsdLoadResult]:
        """Read blocks into L1 slots: slots[i] holds block i's slot address per TP
        shard (shape [len(hashes), shards], or [len(hashes)] for one shard). Never
        blocks; the future completes on a reader thread. A block whose record is
        gone, damaged or of other geometry comes back False and its slots hold
        garbage: the caller frees them. Aligned slots are read into in place
        (store.read_run): no two blocks in flight may share a slot. A load
        once close() began fails with SsdClosed, having read nothing."""
        n = len(hashes)
        table = np.asarray(slots, np.uint64).reshape(n, -1)
        out: Future[SsdLoadResult] = Future()
        ok = np.zeros(n, bool)
        start = time.perf_counter()
        if not n:
            out.set_result(SsdLoadResult(ok, 0, 0.0))
            return out
        # One task per reader thread, not per block: the loop thread does O(1)
        # work here however long the prefix.
        bounds = np.linspace(0, n, min(n, self.config.read_threads) + 1).astype(int)
        remaining = [len(bounds) - 1]

        def done(fut: Future[None]) -> None:
            if (exc := fut.exception()) is not None:
                logger.error("ssd load failed", exc_info=exc)
            with self._lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
                seconds = time.perf_counter() - start
                self._counts["loads"] += 1
                self._counts["blocks"] += n
                self._counts["hits"] += int(ok.sum())
                self._load_seconds += seconds
            nbytes = int(ok.sum()) * table.shape[1] * slot_bytes
            out.set_result(SsdLoadResult(ok, nbytes, seconds))

        with self._loads_gate:
            if self._closed:
                out.set_exception(
                    SsdClosed("ssd load: the tier is closed (the server is stopping)")
                )
                return out
            reads = [
                self._readers.submit(
                    self._read_blocks,
                    ns_digest,
                    hashes[a:b],
                    table[a:b],
                    slot_bytes,
                    ok[a:b],
                )
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]
        for read in reads:  # one done already runs `done` here
            read.add_done_callback(done)
        return out

    def _read_blocks(
        self,
        ns: NsDigest,
        hashes: Sequence[BlockHash],
        table: np.ndarray,
        each: int,
        ok: np.ndarray,
    ) -> None:
        """Read a slice of a load: the blocks' records in runs of up to
        READ_RUN_BYTES, pinned together and read with one request per stretch
        of them that lies back to back on disk (store.read_run)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = AlignedBuffer()
        rows = table.tolist()
        at: list[int] = []  # the block index of each record in run
        run: list[Record] = []  # pinned, not yet handed to read_run
        nbytes = 0
        try:
            for i, block_hash in enumerate([*hashes, None]):
                rec = None if block_hash is None else self.store.pin(ns, block_hash)
                if rec is not None:
                    at.append(i)
                    run.append(rec)
                    nbytes += rec.length
                full = nbytes >= READ_RUN_BYTES or len(run) >= READ_RUN_BLOCKS
                if run and (full or block_hash is None):
                    batch, run = run, []  # read_run unpins them, come what may
                    dests = [rows[j] for j in at]
                    ok[at] = self.store.read_run(batch, dests, each, buf)
                    at, nbytes = [], 0
        finally:
            if run:  # an error before read_run took them
                self.store.unpin(run)

    # -- life cycle --------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued spill is written (or failed); False on timeout."""
        return self._queue.wait_empty(timeout)

    def stats(self) -> SsdStats:
        with self._lock:
            c = dict(self._counts)
            load_seconds = self._load_seconds
        store = asdict(self.store.counters)
        return SsdStats(
            mode=self.mode,
            capacity_bytes=self.store.capacity_bytes,
            stored_bytes=self.store.stored_bytes,
            blocks=self.store.index.count,
            queue_depth=self._queue.unfinished,
            queue_capacity=self.config.queue_blocks,
            spills_queued=c["queued"],
            spills_dropped=c["dropped"],
            spills_skipped=c["skipped"],
            spills_not_admitted=c["not_admitted"],
            loads=c["loads"],
            load_blocks=c["blocks"],
            load_hits=c["hits"],
            load_seconds=load_seconds,
            **store,
        )

    def close(self) -> None:
        """Write what is queued, stop the threads, sync and close the files.
        Loads that began before are read whole first; later ones fail."""
        with self._loads_gate, self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.stop()
        for t in self._writers:
            t.join()
        self._readers.shutdown(wait=True)
        self.store.close()


def _release_range(slices: list[Slice], lo: int, hi: int) -> None:
    """Release blocks [lo, hi) of the slices laid end to end: one call per
    slice they touch."""
    at = 0
    for sl in slices:
        n = sl.hi - sl.lo
        a, b = max(lo, at), min(hi, at + n)
        if a < b and sl.job.release is not None:
            sl.job.release(sl.lo + a - at, sl.lo + b - at)
        at += n
