"""Loads staged through the GPU's own memory (`--load-staging-mib`): the copy
engines move the load's pool slots into a scratch buffer on the GPU, as few
large runs (a slot holds a block's pages of every layer, end to end: 2 MiB
for Llama-3.1-8B, and adjacent slots merge), then the copy kernel scatters
the pages from there into the engine's blocks. Both go on the load stream,
so stream order keeps the scatter after its runs and the next batch's runs
after this scatter.

Why: the kernel reading the pool over PCIe (zero-copy) moves a 64-block load
at ~49.5 GB/s of GPU time where one DMA of the same bytes runs at ~55 GB/s
(H100 and H200, benchmarks/RESULTS.md); copy engines moving the engine's
64 KiB pages one by one reach only ~32 GB/s (a cost per copy). Staged, the
link carries large DMA runs and the scatter reads HBM, two orders of
magnitude faster than the link. The price: the buffer, on every GPU served.

A load larger than the buffer goes in parts of whole rows, each part's runs
then its scatter. Two batches queued from two threads on one stream must not
interleave their runs and scatters (the second's runs would overwrite the
first's staged pages before its scatter read them): a lock holds each
batch's parts together.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.geometry import Transfers

from . import dma

logger = logging.getLogger(__name__)


def parts(nbytes: np.ndarray, capacity: int) -> list[slice] | None:
    """Consecutive row ranges of at most `capacity` bytes each, in order;
    None when one row alone is larger (the load goes unstaged)."""
    if not len(nbytes):
        return []
    if int(nbytes.max()) > capacity:
        return None
    ends = np.cumsum(nbytes, dtype=np.uint64)
    out: list[slice] = []
    start, base = 0, 0
    while start < len(nbytes):
        stop = int(np.searchsorted(ends, base + capacity, "right"))
        out.append(slice(start, stop))
        base, start = int(ends[stop - 1]), stop
    return out


def stage(t: Transfers, rows: slice, base: int) -> tuple[Transfers, Transfers]:
    """Rows `rows` of a load laid end to end from `base` (the buffer's
    address): (pool -> buffer, buffer -> engine). Rows of one slot are
    adjacent in the pool and now in the buffer too, so dma.plan merges them
    into one copy."""
    n = np.ascontiguousarray(t.nbytes[rows], np.uint64)
    at = np.uint64(base) + np.cumsum(n, dtype=np.uint64) - n
    into = Transfers(src=t.src[rows], dst=at, nbytes=n)
    return into, Transfers(src=at, dst=t.dst[rows], nbytes=n)


class LoadStaging:
    """One GPU's staging buffer and how a load goes through it."""

    def __init__(
        self,
        kernels: Any,
        buffer: Any,
        batch: Callable[[dma.BatchPlan, dma.MemcpyAttributes, int], None],
        attrs: dma.MemcpyAttributes,
        pool_chunks: tuple[int, int],
    ) -> None:
        """buffer: a kernels Buffer of device memory; batch: the driver's
        cuMemcpyBatchAsync (dma.MemcpyBatch); pool_chunks: see dma.plan."""
        self._k = kernels
        self.buffer = buffer
        self._batch = batch
        self._attrs = attrs
        self._chunks = pool_chunks
        self._lock = threading.Lock()

    def fits(self, t: Transfers) -> bool:
        """Whether every row fits the buffer (else the load goes unstaged)."""
        return not len(t) or int(t.nbytes.max()) <= self.buffer.nbytes

    def queue(
        self,
        pool: Any,
        engine: Any,
        t: Transfers,
        stream: Any,
        max_ctas: int,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        """Queue the load on `stream` (checked as the kernels and dma.plan
        check every table: InternalError for a row outside its buffer)."""
        pieces = parts(t.nbytes, self.buffer.nbytes)
        assert pieces is not None, "the caller asks fits() first"
        handle = int(stream.handle)
        with self._lock:
            for i, rows in enumerate(pieces):
                into, out = stage(t, rows, self.buffer.address)
                plan = dma.plan(pool, self.buffer, into, self._chunks)
                if i == 0 and before_launch is not None:
                    before_launch()
                self._batch(plan, self._attrs, handle)
                self._k.scatter(
                    self.buffer, engine, out, stream=stream, max_blocks=max_ctas
                )


def open_staging(
    kernels: Any,
    ordinal: int,
    nbytes: int,
    batch: Callable[..., None] | None,
    pool_chunks: tuple[int, int],
) -> LoadStaging | None:
    """The current device's staging (its buffer allocated now), or None when
    `nbytes` is 0 or the driver has no cuMemcpyBatchAsync (logged)."""
    if not nbytes:
        return None
    if batch is None:
        try:
            batch = dma.driver()
        except Exception as exc:  # an older driver: loads go unstaged
            logger.warning("--load-staging-mib: off on device %d (%s)", ordinal, exc)
            return None
    buffer = kernels.staging_buffer(nbytes)
    attrs = dma.attributes("load", ordinal)
    return LoadStaging(kernels, buffer, batch, attrs, pool_chunks)
