"""SsdTier: the seam between the server and the SSD store.

Spills go through a bounded queue to writer threads; a full queue drops the spill
and counts it, so the caller (the event loop, evicting from L1) never waits.
Loads run on a reader pool and complete a concurrent.futures.Future. Lookups are
lock-free dictionary reads. Nothing here touches the asyncio loop.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from .config import SsdConfig
from .format import check_key
from .io import AlignedBuffer
from .ring import BlockHash, NsDigest, Record
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
    queue_depth: int
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
    loads: int
    load_blocks: int
    load_hits: int
    load_seconds: float  # total over loads: divide by loads for the mean


@dataclass(frozen=True, slots=True)
class _Spill:
    ns: NsDigest
    block_hash: BlockHash
    slots: tuple[int, ...]
    slot_bytes: int
    release: Release | None


class SsdTier:
    def __init__(self, config: SsdConfig) -> None:
        self.config = config
        self.store = SsdStore(config)
        self._queue: queue.Queue[_Spill | None] = queue.Queue(config.queue_blocks)
        self._lock = threading.Lock()  # pending keys, ghost list, tier counters
        self._pending: set[tuple[NsDigest, BlockHash]] = set()
        self._ghost: OrderedDict[tuple[NsDigest, BlockHash], None] = OrderedDict()
        self._counts = dict.fromkeys(
            ("queued", "dropped", "skipped", "not_admitted", "loads", "blocks", "hits"),
            0,
        )
        self._load_seconds = 0.0
        self._closed = False
        self._local = threading.local()
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
        check_key(ns_digest, block_hash)
        key = (ns_digest, block_hash)
        with self._lock:
            if self._closed or key in self._pending or self._on_ssd(key):
                self._counts["skipped"] += 1
                return False
            if self.config.admission == "seen_twice" and not self._seen_before(key):
                self._counts["not_admitted"] += 1
                return False
            item = _Spill(*key, tuple(int(a) for a in slots), slot_bytes, release)
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self._counts["dropped"] += 1
                return False
            self._pending.add(key)
            self._counts["queued"] += 1
        return True

    def _on_ssd(self, key: tuple[NsDigest, BlockHash]) -> bool:
        return self.store.index.get(*key) is not None

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
        stop = False
        try:
            while not stop:
                batch, stop = self._take()
                try:
                    self._write_batch(batch, buf)
                except Exception:  # a background loop: log, count, go on
                    logger.exception("ssd spill failed")
                finally:
                    with self._lock:
                        for item in batch:
                            self._pending.discard((item.ns, item.block_hash))
                    for _ in batch:
                        self._queue.task_done()
        finally:
            buf.close()

    def _take(self) -> tuple[list[_Spill], bool]:
        """The next spill and those queued behind it, up to RUN_BYTES, to go to
        disk as one write; and whether this writer's stop sentinel came."""
        batch: list[_Spill] = []
        nbytes = 0
        item = self._queue.get()
        while item is not None:
            batch.append(item)
            nbytes += len(item.slots) * item.slot_bytes
            if nbytes >= RUN_BYTES or len(batch) >= RUN_BLOCKS:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False
        self._queue.task_done()  # the sentinel
        return batch, True

    def _write_batch(self, batch: list[_Spill], buf: AlignedBuffer) -> None:
        """Reserve runs of back-to-back space for the batch (as much of it as one
        ring takes at a time) and write each run in one request: payloads
        straight from their slots where aligned, staged in buf otherwise. The
        slots are released once written (or copied), before the commit."""
        released = 0

        def release(items: list[_Spill]) -> None:
            nonlocal released
            for item in items:
                released += 1
                if item.release is not None:
                    item.release()

        try:
            while released < len(batch):
                rest = batch[released:]
                run = self.store.reserve_run(
                    [(i.ns, i.block_hash, len(i.slots) * i.slot_bytes) for i in rest]
                )
                if not run:
                    return  # counted as no_space; the finally releases the rest
                items = rest[: len(run)]
                payloads = [[(a, i.slot_bytes) for a in i.slots] for i in items]
                self.store.write_run(
                    run, payloads, buf, functools.partial(release, items)
                )
        finally:
            for item in batch[released:]:
                if item.release is not None:
                    item.release()

    # -- lookup and load ---------------------------------------------------------------
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
        (store.read_run): no two blocks in flight may share a slot."""
        n = len(hashes)
        table = np.asarray(slots, np.uint64).reshape(n, -1)
        out: Future[SsdLoadResult] = Future()
        ok = np.zeros(n, bool)
        start = time.perf_counter()
        if not n or self._closed:
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

        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            args = (ns_digest, hashes[a:b], table[a:b], slot_bytes, ok[a:b])
            self._readers.submit(self._read_blocks, *args).add_done_callback(done)
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
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                done.wait(left)
        return True

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
            queue_depth=self._queue.qsize(),
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
        """Write what is queued, stop the threads, sync and close the files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._writers:
            self._queue.put(None)
        for t in self._writers:
            t.join()
        self._readers.shutdown(wait=True)
        self.store.close()
