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
from typing import Any

import numpy as np

from pegaflow.common import deadlines

logger = logging.getLogger(__name__)

# Runs per compiled call: the deadline is checked before each (as the
# process_vm path checks it before each call of at most IOV_MAX iovecs).
CHUNK_RUNS = 1024
_FALLBACK = "shared-memory copies call memmove from Python per run"

RunLoop = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
# (dst, src, nbytes, edges, words, first, seq): layer first + j's runs are
# edges[j]..edges[j + 1], then seq is stored at words[first + j]
LayerLoop = Callable[
    [np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, np.uint64],
    None,
]


def _python_loop(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> None:
    for d, s, k in zip(dst.tolist(), src.tolist(), n.tolist(), strict=True):
        ctypes.memmove(d, s, k)


def _python_layers(
    dst: np.ndarray,
    src: np.ndarray,
    n: np.ndarray,
    edges: np.ndarray,
    words: np.ndarray,
    first: int,
    seq: np.uint64,
) -> None:
    for j in range(len(edges) - 1):
        a, b = int(edges[j]), int(edges[j + 1])
        _python_loop(dst[a:b], src[a:b], n[a:b])
        # ctypes.memmove is libc's: its non-temporal path ends in a fence,
        # and x86 keeps the word's store behind the copy's ordinary ones.
        ctypes.c_uint64.from_address(int(words[first + j])).value = int(seq)


_lock = threading.Lock()
_loop: list[RunLoop] = []  # the one loop, once made
_layers: list[LayerLoop] = []


def run_loop() -> RunLoop:
    """The compiled loop (checked once against numpy), else the fallback;
    made once, whichever thread asks first (the others wait for it)."""
    with _lock:
        if not _loop:
            _loop.append(_compiled("copy_runs", _self_check, _python_loop))
        return _loop[0]


def layer_loop() -> LayerLoop:
    """The compiled layer-by-layer loop, else its Python twin."""
    with _lock:
        if not _layers:
            _layers.append(_compiled("copy_layers", _self_check_layers, _python_layers))
        return _layers[0]


def _compiled(name: str, check: Callable[[Any], None], fallback: Any) -> Any:
    """memcpy_loop's `name`, checked against numpy once, else `fallback`."""
    try:
        from . import memcpy_loop  # numba: not a base dependency
    except ImportError as exc:
        logger.info("%s (%s)", _FALLBACK, exc)
        return fallback
    loop = getattr(memcpy_loop, name)
    try:
        check(loop)
    except Exception as exc:  # an optional speed-up: fall back, never fail
        logger.warning("%s: %s", _FALLBACK, exc)
        return fallback
    return loop


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


def _self_check_layers(loop: LayerLoop) -> None:
    """Two layers of runs, the second empty, from the third word on."""
    src = np.random.default_rng(1).integers(0, 256, 4096, np.uint8)
    dst = np.zeros_like(src)
    words = np.zeros(4, np.uint64)
    at = words.ctypes.data + 8 * np.arange(4, dtype=np.uint64)
    s = src.ctypes.data + np.array([0, 3000], np.uint64)
    d = dst.ctypes.data + np.array([1000, 0], np.uint64)
    edges = np.array([0, 2, 2], np.int64)
    loop(d, s, np.array([900, 96], np.uint64), edges, at, 2, np.uint64(7))
    want = np.zeros_like(src)
    want[1000:1900], want[0:96] = src[0:900], src[3000:3096]
    if not np.array_equal(dst, want) or words.tolist() != [0, 0, 7, 7]:
        raise ValueError("the compiled layer loop copied other bytes")


def copy_layers(
    dst: np.ndarray,
    src: np.ndarray,
    nbytes: np.ndarray,
    edges: np.ndarray,
    words: np.ndarray,
    seq: int,
    op: str,
    deadline: float | None,
) -> None:
    """Layer l's runs (edges[l]..edges[l + 1]), then seq into words[l], for
    every layer, on this thread: the engine's forward reads layer l as soon
    as its word says so, so the layers go in order, not split over threads.
    The deadline is checked before each group of layers of at most
    CHUNK_RUNS runs, as copy_runs checks it."""
    loop = layer_loop()
    dst, src, nbytes, words = (
        np.ascontiguousarray(a, np.uint64) for a in (dst, src, nbytes, words)
    )
    edges = np.ascontiguousarray(edges, np.int64)
    layers = len(edges) - 1
    most = int(np.diff(edges).max()) if layers else 0
    step = max(1, CHUNK_RUNS // max(1, most))
    value = np.uint64(seq)
    for first in range(0, layers, step):
        deadlines.check(deadline, op)
        last = min(first + step, layers)
        loop(dst, src, nbytes, edges[first : last + 1], words, first, value)


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
