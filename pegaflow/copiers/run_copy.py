"""memcpy over (dst, src, nbytes) runs of the server's own memory, for engine
KV the server maps (pegaflow.copiers.shared_kv): one compiled loop over numpy
arrays (numba, GIL released: pegaflow.copiers.memcpy_loop), split over a few
threads by bytes, never a Python step per block or layer. Without numba the
loop is ctypes.memmove per run (it still drops the GIL around each).

The caller has bounds-checked every run against both sides' memory: nothing
here can check an address.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from pegaflow.common import deadlines

logger = logging.getLogger(__name__)

# Runs per compiled call: the deadline is checked before each (as the
# process_vm path checks it before each call of at most IOV_MAX iovecs).
CHUNK_RUNS = 1024
_FALLBACK = "shared-memory copies call memmove from Python per run"

RunLoop = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def _python_loop(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> None:
    for d, s, k in zip(dst.tolist(), src.tolist(), n.tolist(), strict=True):
        ctypes.memmove(d, s, k)


_lock = threading.Lock()
_loop: list[RunLoop] = []  # the one loop, once made


def run_loop() -> RunLoop:
    """The compiled loop (checked once against numpy), else the fallback;
    made once, whichever thread asks first (the others wait for it)."""
    with _lock:
        if not _loop:
            _loop.append(_make_loop())
        return _loop[0]


def _make_loop() -> RunLoop:
    try:
        from .memcpy_loop import copy_runs
    except ImportError as exc:  # numba missing: it is not a base dependency
        logger.info("%s (%s)", _FALLBACK, exc)
        return _python_loop
    try:
        _self_check(copy_runs)
    except Exception as exc:  # an optional speed-up: fall back, never fail
        logger.warning("%s: %s", _FALLBACK, exc)
        return _python_loop
    return copy_runs


def _self_check(loop: RunLoop) -> None:
    """Three runs of unequal lengths, one of them empty, against numpy."""
    src = np.random.default_rng(0).integers(0, 256, 9000, np.uint8)
    dst = np.zeros_like(src)
    s = src.ctypes.data + np.array([0, 100, 5000], np.uint64)
    d = dst.ctypes.data + np.array([4000, 0, 5000], np.uint64)
    loop(d, s, np.array([3000, 7, 0], np.uint64))
    want = np.zeros_like(src)
    want[4000:7000], want[0:7] = src[0:3000], src[100:107]
    if not np.array_equal(dst, want):
        raise ValueError("the compiled memcpy loop copied other bytes")


def split_by_bytes(nbytes: np.ndarray, parts: int) -> list[slice]:
    """At most `parts` consecutive slices of about equal bytes."""
    if parts <= 1 or len(nbytes) <= 1:
        return [slice(0, len(nbytes))]
    ends = np.cumsum(nbytes, dtype=np.float64)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, "right")
    edges = np.unique(np.concatenate(([0], cuts, [len(nbytes)])))
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def copy_runs(
    dst: np.ndarray,
    src: np.ndarray,
    nbytes: np.ndarray,
    op: str,
    deadline: float | None,
    pool: ThreadPoolExecutor | None,
    parts: int,
) -> None:
    """Copy every run; the calling thread takes the last part itself."""
    loop = run_loop()
    dst, src, nbytes = (np.ascontiguousarray(a, np.uint64) for a in (dst, src, nbytes))

    def part(s: slice) -> None:
        for a in range(s.start, s.stop, CHUNK_RUNS):
            b = min(a + CHUNK_RUNS, s.stop)
            deadlines.check(deadline, op)
            loop(dst[a:b], src[a:b], nbytes[a:b])

    slices = split_by_bytes(nbytes, parts if pool is not None else 1)
    futures = [pool.submit(part, s) for s in slices[:-1]] if pool else []
    try:
        part(slices[-1])
    finally:
        wait(futures)  # never return while a part still writes
    for f in futures:
        f.result()
