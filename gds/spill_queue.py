"""The SSD tier's write queue: spills arrive as jobs of many blocks (one per
save that sealed them, or one evicted block) and leave as slices of them.

Bounded in blocks, not in jobs: a job that does not fit whole is cut to the
room left and the rest dropped (the caller counts them), so a save never waits.
A job crosses to a writer in one lock round and comes back as one release per
slice written, so neither side pays a lock, a wake-up or a callback per block:
per-block handoffs were what made the tier's mere presence cost saves a
quarter of their rate (benchmarks/RESULTS.md, "2026-12-02, second session").
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .records import Payloads, SlotTable
from .ring import BlockHash, NsDigest

# Called once per slice of a job, from a writer thread, as soon as the slice's
# slot bytes are no longer needed: with the slice's [lo, hi) in job order.
SliceRelease = Callable[[int, int], None]


@dataclass(slots=True, eq=False)
class Job:
    """Blocks of one namespace queued together; block i's payload is the
    `slot_bytes` at each address of slots[i] (one per TP shard), back to back."""

    ns: NsDigest
    hashes: list[BlockHash]
    slots: np.ndarray  # uint64 [n, shards]
    slot_bytes: int
    release: SliceRelease | None
    taken: int = 0  # blocks handed to writers so far

    @property
    def block_bytes(self) -> int:
        return self.slots.shape[1] * self.slot_bytes


@dataclass(frozen=True, slots=True)
class Slice:
    job: Job
    lo: int
    hi: int


class SpillQueue:
    """Jobs waiting for the writers, at most `capacity` blocks not yet taken.
    `lock` is the tier's: callers that check more state under it (pending
    keys, counters) hold it around `room` and `put`."""

    def __init__(self, capacity: int, lock: threading.Lock) -> None:
        self.capacity = capacity
        self.lock = lock
        # Two conditions on the one lock: a put must wake a writer, not a flush.
        self._work = threading.Condition(lock)
        self._empty = threading.Condition(lock)
        self._jobs: deque[Job] = deque()
        self.queued = 0  # blocks not yet taken by a writer
        self.unfinished = 0  # blocks queued or being written
        self._stopping = False

    def room(self) -> int:
        """Blocks a put may add now (call under lock)."""
        return self.capacity - self.queued

    def put(self, job: Job) -> None:
        """Queue a job that fits `room` (call under lock)."""
        n = len(job.hashes)
        self._jobs.append(job)
        self.queued += n
        self.unfinished += n
        self._work.notify()

    def take(self, max_bytes: int, max_blocks: int) -> list[Slice] | None:
        """The next blocks in queue order, up to max_bytes / max_blocks (at
        least one block), as slices of their jobs; waits for some. None once
        `stop` was called and nothing is left."""
        with self._work:
            while not self._jobs:
                if self._stopping:
                    return None
                self._work.wait()
            out: list[Slice] = []
            nbytes = blocks = 0
            while self._jobs and nbytes < max_bytes and blocks < max_blocks:
                job = self._jobs[0]
                each = job.block_bytes
                left = len(job.hashes) - job.taken
                n = min(left, max_blocks - blocks, max(1, (max_bytes - nbytes) // each))
                out.append(Slice(job, job.taken, job.taken + n))
                job.taken += n
                nbytes += n * each
                blocks += n
                if n == left:
                    self._jobs.popleft()
            self.queued -= blocks
            if self._jobs:  # more for another writer
                self._work.notify()
            return out

    def done(self, blocks: int) -> None:
        """Blocks taken earlier are written or failed (call under lock)."""
        self.unfinished -= blocks
        if not self.unfinished:
            self._empty.notify_all()

    def wait_empty(self, timeout: float | None) -> bool:
        """Until nothing is queued or being written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._empty:
            while self.unfinished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._empty.wait(left)
        return True

    def stop(self) -> None:
        """Writers finish what is queued, then `take` returns None."""
        with self._work:
            self._stopping = True
            self._work.notify_all()


def payloads_of(slices: list[Slice]) -> Payloads:
    """The slices' payloads, block by block: one SlotTable when they share a
    geometry (shards, slot bytes), the usual case and the one written with
    array operations; else (address, bytes) parts per block."""
    jobs = [sl.job for sl in slices]
    first = jobs[0]
    tables = [sl.job.slots[sl.lo : sl.hi] for sl in slices]
    if all(
        j.slot_bytes == first.slot_bytes and j.slots.shape[1] == first.slots.shape[1]
        for j in jobs
    ):
        return SlotTable(np.concatenate(tables), first.slot_bytes)
    return [
        [(a, job.slot_bytes) for a in row]
        for job, table in zip(jobs, tables, strict=True)
        for row in table.tolist()
    ]
