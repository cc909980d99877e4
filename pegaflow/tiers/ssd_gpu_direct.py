"""SSD hits read straight into a CUDA engine's GPU blocks (--ssd-gpu-direct).

The L1 route (pegaflow.tiers.ssd_link) answers a query whose blocks are on the SSD with
`loading`, reads them into fresh L1 slots, and serves them from there as hits:
SSD → L1 → GPU. Where gds.gpu_route chooses the direct route (GPUDirect
Storage present, or the setting `on`), a query of an instance this route
serves is answered `ready` at once instead: its lease holds the L1 hits and,
after them, the hashes of the blocks the SSD holds (Lease.direct; nothing is
pinned for them, on disk or in L1). The engine's Load then reads those
records with kvikio into its own GPU blocks (gds.gpu_reads.DirectReads: every
read of the load in flight at once, each record's checksum checked on the
bytes fetched back from the GPU), before the L1 part is copied, so that a
layer-by-layer load signals no layer before all of its blocks are there.

A record the SSD dropped since the query, one that fails its checks, or a
load past its deadline fails its item: its error tells the engine, whose
blocks may hold garbage, to recompute them (vLLM's load errors). Served:
instances whose every worker is a CUDA engine of this server, and namespaces
of one shard per block (TP 1, or replicated MLA KV): a record of several TP
shards is checksummed over all of them, which one rank's read cannot check.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from pegaflow.cache.instances import Instance, Worker
from pegaflow.common import cuda_driver
from pegaflow.common.errors import CopyFailed, DeadlineExceeded
from pegaflow.common.keys import BlockHash
from pegaflow.daemon.startup import StartupError

from .protocol import MISS, Lookup, Tier
from .ssd_link import SsdLink
from .ssd_metrics import SsdTierMetrics

if TYPE_CHECKING:
    from pegaflow.gds.config import GpuDirect
    from pegaflow.gds.gpu_reads import DirectReads
    from pegaflow.gds.gpu_route import RouteChoice

logger = logging.getLogger(__name__)

# Loads whose reads run at once; each keeps its reads in kvikio's own pool.
LOAD_THREADS = 2


def choose_route(setting: GpuDirect, cuda_devices: bool) -> RouteChoice:
    """--ssd-gpu-direct for this server: gds.gpu_route's choice, refused at
    start where `on` cannot be had."""
    from pegaflow.gds import gpu_route

    if not cuda_devices:
        if setting == "on":
            raise StartupError(
                "--ssd-gpu-direct on: this server copies to no GPU; give it "
                "--devices, or use auto or off"
            )
        return gpu_route.RouteChoice("l1", "no CUDA devices")
    try:
        return gpu_route.choose(setting, gpu_route.gds_present())
    except ValueError as exc:
        raise StartupError(f"--ssd-gpu-direct {setting}: {exc}") from None


class SsdDirect(Tier):
    """A Tier whose hits are read at the engine's Load, not brought into L1."""

    medium = "ssd"

    def __init__(
        self,
        link: SsdLink,
        cuda_copier: object,
        metrics: SsdTierMetrics,
        reads: DirectReads | None = None,
    ) -> None:
        """cuda_copier: the server's CUDA copy engine (its workers are the
        ones served); reads: the direct reader (default: kvikio's, opened on
        the tier's files now, so a kvikio that cannot open them fails the
        start)."""
        if reads is None:
            from pegaflow.gds.gpu_reads import DirectReads

            reads = DirectReads(link.tier)
        self._link = link
        self._cuda = cuda_copier
        self._metrics = metrics
        self._reads = reads
        self._threads = ThreadPoolExecutor(LOAD_THREADS, "ssd-gpu-load")
        self._local = threading.local()  # a DeviceFetch per thread and GPU
        self._closed = False  # on the loop, as load's check: no race between

    def serves(self, inst: Instance) -> bool:
        return (
            inst.namespace.tp_size == 1
            and bool(inst.workers)
            and all(w.copier is self._cuda for w in inst.workers.values())
        )

    def lookup(self, inst: Instance, hashes: list[BlockHash], start: int) -> Lookup:
        """A `hit` of the blocks from `start` on that the SSD holds, read by
        `load` at the engine's Load; a miss for instances not served here."""
        if not self.serves(inst):
            return MISS
        n = self._link.on_ssd(inst.namespace, hashes, start)
        return Lookup("hit", n, read=self.load) if n else MISS

    async def load(
        self,
        worker: Worker,
        hashes: list[BlockHash],
        block_ids: np.ndarray,
        deadline: float | None,
    ) -> np.ndarray:
        """Block i (hashes[i]) into the worker's block block_ids[i]; True
        where it landed and checked."""
        if self._closed:  # its pool and files are going or gone
            raise CopyFailed(
                "ssd direct read: the server is stopping; nothing was read, "
                "recompute the blocks"
            )
        digest = self._link.digest(worker.namespace.id)
        start = time.perf_counter()
        read = self._threads.submit(
            self._read, worker, digest, hashes, block_ids, deadline
        )
        try:
            ok = await asyncio.wrap_future(read)
        except DeadlineExceeded:  # none of them counts as loaded
            self._metrics.direct_blocks.labels("failed").inc(len(hashes))
            raise
        self._metrics.direct_seconds.observe(time.perf_counter() - start)
        loaded = int(ok.sum())
        self._metrics.direct_blocks.labels("loaded").inc(loaded)
        if loaded < len(ok):
            self._metrics.direct_blocks.labels("failed").inc(len(ok) - loaded)
            logger.info(
                "%d of %d blocks read from ssd to the gpu failed; the engine "
                "recomputes them",
                len(ok) - loaded,
                len(ok),
            )
        return ok

    def _read(
        self,
        worker: Worker,
        digest: bytes,
        hashes: list[BlockHash],
        block_ids: np.ndarray,
        deadline: float | None,
    ) -> np.ndarray:
        regions: Any = worker.handle  # a CudaRegions: serves() said so
        ordinal = regions.device.ordinal
        cuda_driver.set_device(ordinal)
        fetches = self._local.__dict__.setdefault("fetches", {})
        fetch = fetches.get(ordinal)
        if fetch is None:
            from pegaflow.copiers.fetch_back import DeviceFetch

            fetch = fetches[ordinal] = DeviceFetch()
        spans = list(zip(regions.bases, regions.sizes, strict=True))
        result = self._reads.load(
            digest, hashes, block_ids, worker.geometry, spans, fetch, deadline
        )
        return result.ok

    async def close(self) -> None:
        """Loads that began are read whole; those after fail (CopyFailed)."""
        self._closed = True
        await asyncio.to_thread(self._threads.shutdown, wait=True)
        self._reads.close()
