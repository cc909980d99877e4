"""Give freed heap back to the kernel after large requests.

A burst of large gRPC messages (64 queries of 8 MiB, issue 30 #4) leaves
hundreds of MiB free inside glibc's heap: the messages' buffers, grpc's
slices and the parse's temporaries are freed, but in pieces between live
allocations, so the heap's top never shrinks and RSS stays (measured: 1,439
MiB after the burst, 150 MiB once malloc_trim(0) ran). malloc_trim also
releases the free pages in the middle of every arena (MADV_DONTNEED).

It walks every arena under their locks (a few ms per GiB of heap), so it runs
on a thread of its own, once a burst is over: QUIET_S after the last large
request it was told of. On a libc without malloc_trim (musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

QUIET_S = 0.5  # no large request for this long: the burst is over
TRIM_AFTER_BYTES = 1 << 20  # a request this large leaves pieces worth trimming


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """note() each large request as it ends; the heap is trimmed QUIET_S after
    the last. Thread-safe; the thread starts at the first note()."""

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self._trim = _malloc_trim()
        self._quiet_s = quiet_s
        self._noted = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.trims = 0  # how many ran (for tests and /stats)

    def note(self, nbytes: int) -> None:
        if nbytes < TRIM_AFTER_BYTES or self._trim is None:
            return
        self._noted.set()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="heap-trim", daemon=True
                    )
                    self._thread.start()

    def _run(self) -> None:
        assert self._trim is not None
        while True:
            self._noted.wait()
            self._noted.clear()
            while self._noted.wait(self._quiet_s):  # still busy: wait it out
                self._noted.clear()
            self._trim(0)  # ctypes lets the GIL go meanwhile
            self.trims += 1
            logger.debug("heap trimmed after large requests")
