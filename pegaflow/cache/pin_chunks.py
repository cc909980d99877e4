"""The pool pinned for the GPUs chunk by chunk beside a serving server, and
which chunks are pinned, so a copy waits only for the chunks it touches.

cudaHostRegister pins ~0.1 s per GiB on the H100 host (benchmarks/RESULTS.md,
"Warm restart"): a restarted server with a 64 GiB pool took 10.2 s to a GPU
engine's first hit while the whole pool was pinned first. Here the chunks
(HostRegistrar's, 1 GiB) are pinned by a few threads in address order, and a
copy that needs a chunk not pinned yet moves it to the front of the queue and
waits for it alone. A kernel or a DMA on an unpinned range faults the CUDA
context for good, so no copy starts before its chunks are pinned.

The first chunk that fails stops the pinning: the failure is kept, waiting
copies get it (never a hang), and copies of chunks pinned before it go on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from pegaflow.common.errors import CopyFailed, DeadlineExceeded, DeviceBroken

logger = logging.getLogger(__name__)

Explain = Callable[[BaseException], BaseException]  # a failure as engines read it


class ChunkRegistrar(Protocol):
    """Pins one chunk for DMA (pegaflow.common.cuda_driver.HostRegistrar)."""

    chunk_bytes: int
    threads: int

    def register_chunk(self, address: int, size: int) -> None: ...
    def unregister_chunk(self, address: int) -> None: ...


class ChunkPins:
    """`pinned[k]`: whether chunk k (bytes [k, k + 1) * chunk_bytes of the
    pool) is pinned. Threads wait with `wait`; `ready` asks without waiting
    (the event loop). Both move the chunks they need to the queue's front."""

    def __init__(
        self,
        base: int,
        size: int,
        registrar: ChunkRegistrar,
        explain: Explain | None = None,
        hold: bool = False,
    ) -> None:
        """hold: pin only the chunks copies ask for until release()."""
        self.base, self.size = base, size
        self.chunk_bytes = registrar.chunk_bytes
        self._registrar = registrar
        self._explain = explain or (lambda exc: exc)
        self.count = -(-size // self.chunk_bytes)
        self.pinned = np.zeros(self.count, bool)
        self.complete = self.count == 0  # every chunk pinned: no copy checks
        self.failure: BaseException | None = None
        self.seconds: float | None = None  # start -> all pinned
        self._taken = np.zeros(self.count, bool)  # being pinned or done
        self._urged = np.zeros(self.count, bool)  # in _urgent already
        self._urgent: collections.deque[int] = collections.deque()
        self._next = 0  # the next chunk in address order
        self._stopping = False
        self._held = hold
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._start = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()
        for i in range(min(self._registrar.threads, self.count)):
            thread = threading.Thread(
                target=self._pin_chunks, name=f"pegaflow-pin-{i}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def chunks_of(self, addresses: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """The chunks that byte ranges [address, address + nbytes) touch."""
        offsets = np.asarray(addresses, np.uint64) - np.uint64(self.base)
        last = offsets + np.asarray(nbytes, np.uint64) - np.uint64(1)
        chunk, top = np.uint64(self.chunk_bytes), np.uint64(self.count - 1)
        # A range outside the pool (below it: wrapped) is clipped to a chunk
        # here; the copy's own range check refuses it before any launch.
        first = np.minimum(offsets // chunk, top).astype(np.int64)
        end = np.minimum(last // chunk, top).astype(np.int64) + 1
        # Every chunk from each range's first to its last, however long it is.
        starts = np.zeros(self.count + 1, np.int64)
        np.add.at(starts, first, 1)
        np.add.at(starts, np.maximum(end, first + 1), -1)
        return np.flatnonzero(np.cumsum(starts[:-1]) > 0)

    def ready(self, chunks: np.ndarray) -> bool:
        """Whether every chunk is pinned; those that are not go first."""
        if self.pinned[chunks].all():
            return True
        with self._cond:
            self._urge(chunks)
        return False

    def wait(self, chunks: np.ndarray, deadline: float | None, what: str) -> None:
        """Until every chunk is pinned (they go first). Raises DeviceBroken
        when pinning failed, DeadlineExceeded past `deadline` (monotonic),
        CopyFailed when the server stops first."""
        if self.pinned[chunks].all():
            return
        with self._cond:
            self._urge(chunks)
            while (missing := chunks[~self.pinned[chunks]]).size:
                self._refuse(missing, what)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DeadlineExceeded(
                        f"{what}: the request's deadline passed while pool chunk(s) "
                        f"{_names(missing)} were being pinned for the GPUs (a "
                        "restarted server pins its pool beside serving); nothing "
                        "was copied"
                    )
                self._cond.wait(left)

    def wait_all(self) -> None:
        """Until every chunk is pinned; DeviceBroken naming the failure if
        one was not."""
        self.wait(np.arange(self.count), None, "pinning the pool")

    def release(self) -> None:
        """Pin the rest in address order too (after hold)."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def stop(self) -> None:
        """Pin no more chunks; returns once those being pinned are done."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def unpin(self) -> None:
        """stop(), then unregister the chunks that were pinned (only those)."""
        self.stop()
        self.complete = False
        for k in np.flatnonzero(self.pinned).tolist():
            self.pinned[k] = False
            self._registrar.unregister_chunk(self.base + k * self.chunk_bytes)

    def report(self) -> dict[str, object]:
        """/health's pinning progress."""
        failure = self.failure
        return {
            "chunks_pinned": int(self.pinned.sum()),
            "chunks": self.count,
            "seconds": None if self.seconds is None else round(self.seconds, 2),
            "failed": None if failure is None else str(failure),
        }

    # -- the pinning threads ----------------------------------------------------
    def _pin_chunks(self) -> None:
        while (k := self._take()) is not None:
            address = self.base + k * self.chunk_bytes
            size = min(self.chunk_bytes, self.base + self.size - address)
            try:
                self._registrar.register_chunk(address, size)
            except BaseException as exc:  # kept: waiting copies get it
                self._failed(k, exc)
                return
            self._landed(k)

    def _take(self) -> int | None:
        with self._cond:
            while True:
                if self._stopping or self.failure is not None:
                    return None
                while self._urgent:
                    k = self._urgent.popleft()
                    if not self._taken[k]:
                        self._taken[k] = True
                        return k
                if not self._held:
                    break
                self._cond.wait()  # an urgent chunk, release() or stop()
            while self._next < self.count and self._taken[self._next]:
                self._next += 1
            if self._next == self.count:
                return None
            self._taken[self._next] = True
            return self._next

    def _landed(self, k: int) -> None:
        with self._cond:
            self.pinned[k] = True
            if self.pinned.all():
                self.seconds = time.perf_counter() - self._start
                self.complete = True
                logger.info(
                    "pool pinned for the GPUs: %d chunk(s), %.2f GiB in %.2f s",
                    self.count,
                    self.size / (1 << 30),
                    self.seconds,
                )
            self._cond.notify_all()

    def _failed(self, k: int, exc: BaseException) -> None:
        try:
            failure = self._explain(exc)
        except Exception:  # wording it must never leave waiters hanging
            failure = exc
        with self._cond:
            if self.failure is None:
                self.failure = failure
                logger.error(
                    "pinning pool chunk %d for the GPUs failed (%d of %d pinned); "
                    "CUDA copies of the chunks not pinned fail: %s",
                    k,
                    int(self.pinned.sum()),
                    self.count,
                    self.failure,
                    exc_info=exc,
                )
            self._cond.notify_all()

    def _urge(self, chunks: np.ndarray) -> None:
        """Queue the chunks not yet taken before all others (under the lock)."""
        new = chunks[~(self._taken[chunks] | self._urged[chunks])]
        self._urged[new] = True
        self._urgent.extend(new.tolist())
        if new.size:
            self._cond.notify_all()  # held threads take them

    def _refuse(self, missing: np.ndarray, what: str) -> None:
        """Raise if the missing chunks will never be pinned (under the lock)."""
        if self.failure is not None:
            raise DeviceBroken(
                f"{what}: pool chunk(s) {_names(missing)} could not be pinned for "
                f"the GPUs ({self.failure}); CUDA copies of them fail until the "
                "server restarts (see /health)"
            )
        if self._stopping:
            raise CopyFailed(
                f"{what}: the server is stopping; pool chunk(s) {_names(missing)} "
                "were never pinned for the GPUs"
            )


def _names(chunks: np.ndarray, most: int = 4) -> str:
    shown = ", ".join(map(str, chunks[:most].tolist()))
    return shown + (f" (+{len(chunks) - most} more)" if len(chunks) > most else "")
