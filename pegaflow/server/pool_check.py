"""A warm restart's checksum pass, off the start-up path.

A restarted server (pegaflow.server.warm_restart) puts every block its kept
pool file holds into the store pinned and in flight: never served, never
evicted unless the pool is full (first then: BlockStore.unchecked), a save of
the key waiting for its check. It serves at once; threads here then
hash the blocks' SEALED rows (pegaflow.cache.slot_log.checksums) in the file's
row order, and the event loop publishes each batch's good blocks
(BlockStore.finish_load: ready, evictable) and frees the bad ones. A query
that reaches a block not yet checked gets `loading` (this is the first of the
server's tiers) and moves the run of unchecked blocks it asked for to the head
of the queue; the engine asks again and hits once they passed. No block is
served before its bytes were checked against the checksum its row holds.

The check once ran before the server answered anything: ~0.7 s a GiB on the
dev VM and 0.15 s a GiB on the H200 host, the whole pool's worth before the
first hit (benchmarks/RESULTS.md, warm restart).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import compress

import numpy as np

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.instances import Instance
from pegaflow.cache.slot_log import checksums
from pegaflow.common.keys import BlockHash, Key
from pegaflow.tiers.protocol import MISS, Lookup, Tier

logger = logging.getLogger(__name__)

# A batch's bytes: small enough that a query's blocks wait behind at most one
# batch per thread, large enough that the per-batch Python is noise.
BATCH_BYTES = 64 << 20
# Rows of this size and more are hashed one python-xxhash call each: no
# compiled loop to wait for (slot_log.checksums' per_row).
PER_ROW_BYTES = 64 << 10


@dataclass(slots=True)
class RecoveryReport:
    """/health's `pool_recovered`: what a kept pool file gave back. Updated on
    the event loop while the check runs (the HTTP thread reads it), hence
    not frozen."""

    blocks: int = 0  # found whole at start, less those failing their check
    bytes: int = 0
    namespaces: int = 0
    torn: int = 0  # slots whose write was in flight (WRITING): dropped
    bad_checksum: int = 0  # blocks dropped, so far
    unsealed: int = 0  # LANDED, not yet checksummed: kept (pegaflow.cache.slot_log)
    incomplete: int = 0  # slots of blocks missing a shard or inconsistent
    seconds: float = 0.0  # from the file's mapping to serving
    unchecked: int = 0  # blocks whose check is still to come: not served yet
    check_seconds: float | None = None  # the whole check, once done
    damaged: int = 0  # rows whose state word is none of the states: dropped


@dataclass(frozen=True, slots=True)
class Pending:
    """Blocks adopted unchecked: entry i's SEALED rows are rows[starts[i]:
    starts[i + 1]] (its shards' rows, LANDED ones not hashed)."""

    entries: list[BlockEntry]
    rows: np.ndarray  # int64
    starts: np.ndarray  # int64, len(entries) + 1
    sizes: np.ndarray  # bytes to hash per entry
    nbytes: np.ndarray  # bytes per entry (every shard's slot)
    ready: int = 0  # blocks published at once: no SEALED row to compare
    ready_bytes: int = 0


class PoolCheck(Tier):
    """The background check, and the tier that answers `loading` for the
    blocks it has not reached. It hears the store's events (Engine.add_tier):
    an unchecked block evicted is one less to check."""

    # /stats lists it under L1 ("ram"), whose blocks these are; it counts no
    # hits of its own (its lookups never say `started`).
    medium = "ram"  # type: ignore[assignment]

    def __init__(
        self,
        table: np.ndarray,
        data: np.ndarray,
        store: BlockStore,
        pending: Pending,
        report: RecoveryReport,
        rate: int = 0,
    ) -> None:
        """rate: bytes a second the background pass reads at most (0: no
        cap); a query's blocks are checked at once whatever it is."""
        self._table, self._data, self._store = table, data, store
        self._p = pending
        self.outcome = report
        self._rate = rate
        # Under a cap, batches of a tenth of a second's worth (a block at
        # least): the pause after each then keeps the rate from the start.
        self._batch = min(BATCH_BYTES, max(1, rate // 10)) if rate else BATCH_BYTES
        self._index: dict[Key, int] = {e.key: i for i, e in enumerate(pending.entries)}
        self._taken = np.zeros(len(pending.entries), bool)
        # Blocks a query or a save asked for (on the loop): published as
        # just used. The rest enter below every block used since the start:
        # rows record no recency, a pass that reached them is no use, and a
        # block engines asked for since is the likelier to be asked again (the
        # pass once put the whole pool above those, so they went first when
        # the pool filled).
        self._asked = np.zeros(len(pending.entries), bool)
        self._cursor = 0
        self._urgent: collections.deque[int] = collections.deque()
        self._wake = threading.Condition()  # guards the queue and the cursor
        self._stop = threading.Event()
        self._resume = 0.0  # time.monotonic() the rate lets the file order go on
        self._threads: list[threading.Thread] = []
        self._apply: Callable[[np.ndarray, np.ndarray], None] = self._publish
        self._started = time.perf_counter()
        self._when_done: list[Callable[[], None]] = []
        report.unchecked = len(pending.entries)

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the event loop) once every block was checked;
        at once if none is left."""
        if self.outcome.check_seconds is not None:
            callback()
        else:
            self._when_done.append(callback)

    # -- the tier ---------------------------------------------------------------
    def lookup(self, inst: Instance, hashes: list[BlockHash], start: int) -> Lookup:
        if not self._index:
            return MISS
        ns_id = inst.namespace.id
        run: list[int] = []
        for h in hashes[start:]:
            i = self._index.get((ns_id, h))
            if i is None:
                break
            run.append(i)
        if not run:
            return MISS
        self._hurry(run)
        return Lookup("loading", len(run))

    def _hurry(self, run: list[int]) -> None:
        self._asked[run] = True
        with self._wake:  # polled again and again: queued once
            self._urgent.extend(i for i in run if not self._taken[i])
            self._wake.notify()

    # -- the store's events -------------------------------------------------------
    def awaited(self, entries: list[BlockEntry]) -> None:
        """A save waits for these blocks (pegaflow.server.save_waits): those
        still to check go first, as a query's do."""
        index = self._index
        run = [i for e in entries if (i := index.get(e.key)) is not None]
        if run:
            self._hurry(run)

    def unchecked_evicted(self, keys: list[Key]) -> None:
        """Blocks evicted before their check: never checked now (a result a
        thread brings in for one is dropped); still counted as found, as a
        checked block evicted later is."""
        gone = [i for key in keys if (i := self._index.pop(key, None)) is not None]
        if not gone:
            return
        with self._wake:
            self._taken[gone] = True
        r = self.outcome
        r.unchecked -= len(gone)
        if r.unchecked == 0:
            self._done()

    def report(self) -> dict[str, object]:
        return {"unchecked_blocks": self.outcome.unchecked}

    async def close(self) -> None:
        """Stop the threads before the pool goes (they read its mapping);
        what they had not reached stays as it is in the file, for the next
        start to check."""
        with self._wake:
            self._stop.set()
            self._wake.notify_all()
        self._apply = _drop
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()

    # -- the pass ---------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, threads: int) -> None:
        """Check in `threads` threads; results are published on `loop`."""
        if not len(self._taken):
            self._done()
            return

        def post(batch: np.ndarray, ok: np.ndarray) -> None:
            loop.call_soon_threadsafe(lambda: self._apply(batch, ok))

        for n in range(threads):
            t = threading.Thread(
                target=self._work, args=(post,), name=f"pegaflow-check-{n}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def run_here(self) -> None:
        """The whole pass in this thread, publishing as it goes (tools, tests)."""
        self._work(lambda batch, ok: self._apply(batch, ok))
        if self.outcome.unchecked == 0 and self.outcome.check_seconds is None:
            self._done()

    def _work(self, post: Callable[[np.ndarray, np.ndarray], None]) -> None:
        while (batch := self._next()) is not None:
            try:
                ok = self._check(batch)
            except Exception:  # its blocks dropped, never served unchecked
                logger.exception("pool file: checking %d blocks failed", len(batch))
                ok = np.zeros(len(batch), bool)
            # Posted either way: a batch left taken would hold its blocks
            # pinned and `loading` for good, and the check never end.
            post(batch, ok)

    def _next(self) -> np.ndarray | None:
        """The next batch: blocks a query waits for first, at once; then file
        order, no faster than the rate (a pause that a query's blocks cut
        short). None when every block is taken, or at close()."""
        with self._wake:
            while not self._stop.is_set():
                if (taken := self._take(self._urgent_ids(), BATCH_BYTES)) is not None:
                    return taken
                if self._cursor >= len(self._taken):
                    return None
                wait = self._resume - time.monotonic()
                if wait <= 0:
                    taken = self._take(self._file_order(), self._batch)
                    if taken is not None and self._rate:
                        owed = float(self._p.sizes[taken].sum()) / self._rate
                        self._resume = max(self._resume, time.monotonic()) + owed
                    return taken
                self._wake.wait(wait)
            return None

    def _urgent_ids(self) -> Iterator[int]:
        while self._urgent:
            yield self._urgent.popleft()

    def _file_order(self) -> Iterator[int]:
        while self._cursor < len(self._taken):
            self._cursor += 1
            yield self._cursor - 1

    def _take(self, ids: Iterator[int], limit: int) -> np.ndarray | None:
        """Blocks from `ids` not taken yet, up to `limit` bytes (one at least)."""
        taken: list[int] = []
        size = 0
        for i in ids:
            if not self._taken[i]:
                self._taken[i] = True
                taken.append(i)
                size += int(self._p.sizes[i])
                if size >= limit:
                    break
        return np.asarray(taken, np.int64) if taken else None

    def _check(self, batch: np.ndarray) -> np.ndarray:
        """Whether every SEALED row of each block matches its checksum."""
        starts = self._p.starts[batch]
        counts = self._p.starts[batch + 1] - starts
        rows = self._p.rows[np.repeat(starts, counts) + _ranges(counts)]
        if not len(rows):
            return np.ones(len(batch), bool)
        t = self._table
        per_row = int(t["slot_bytes"][rows].min()) >= PER_ROW_BYTES
        try:
            good = checksums(t, self._data, rows, per_row) == t["checksum"][rows]
        except ValueError:  # a slot outside the data: _plausible let none by
            good = np.zeros(len(rows), bool)
        owner = np.repeat(np.arange(len(batch)), counts)
        bad = np.zeros(len(batch), bool)
        bad[owner[~good]] = True
        return ~bad

    # -- on the loop ------------------------------------------------------------
    def _publish(self, batch: np.ndarray, ok: np.ndarray) -> None:
        entries = [self._p.entries[i] for i in batch.tolist()]
        # Those evicted meanwhile (unchecked_evicted) left the store's
        # unchecked set: their slots may hold other blocks' bytes by now.
        unchecked = self._store.unchecked
        live = np.array([unchecked.get(e.key) is e for e in entries], bool)
        for entry in entries:
            self._index.pop(entry.key, None)
        if not live.all():
            batch, ok = batch[live], ok[live]
            entries = list(compress(entries, live.tolist()))
            if not entries:
                return
        self._store.finish_load(entries, ok, cold=~self._asked[batch])
        r = self.outcome
        bad = int(len(ok) - ok.sum())
        r.unchecked -= len(batch)
        r.bad_checksum += bad
        r.blocks -= bad
        r.bytes -= int(self._p.nbytes[batch[~ok]].sum())
        if r.unchecked == 0:
            self._done()

    def _done(self) -> None:
        r = self.outcome
        if r.check_seconds is not None:  # an eviction ended it already
            return
        r.check_seconds = round(time.perf_counter() - self._started, 3)
        logger.info(
            "pool file: checked in %.2f s: %d blocks (%.2f GiB) served, %d "
            "dropped failing their checksum",
            r.check_seconds,
            r.blocks,
            r.bytes / (1 << 30),
            r.bad_checksum,
        )
        callbacks, self._when_done = self._when_done, []
        for callback in callbacks:
            callback()


def _drop(batch: np.ndarray, ok: np.ndarray) -> None:
    """Results that come in after close(): the pool is going."""


def _ranges(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count, back to back."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(counts.cumsum() - counts, counts)
