"""SSD → GPU direct loads: kvikio (cuFile) reads SSD records straight into an
engine's GPU blocks (the IPC-opened device pointers), skipping the L1 hop.

One load is one batch: every record's header page (into host memory) and every
payload read of the plan (gds.gpu_plan, into device memory) is issued before
any is waited on; kvikio's thread pool, or GDS, keeps them in flight together.

Checking: with a direct read the host never sees the payload, and a record's
checksum (xxh3-64 by default, gds.format) is one sequential hash over the whole
payload, which no GPU kernel here computes. So the landed bytes are fetched
back into host memory (`FetchBack`: the server's copy kernels or copy engines,
~50 GB/s on the H200, against ~1.5 GB/s from the disk) and hashed there, on a
few threads (xxh3 drops the GIL). A record whose header or checksum does not
match is reported not loaded (its engine block holds garbage until the
engine's recompute overwrites it) and dropped from the store, as the L1
route's read (SsdTier.load) drops one: a query must not lease it again.

Records stay pinned in the store (`SsdStore.pin`) from planning until their
bytes are checked, so the ring never reuses their space under a read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pegaflow.common import deadlines
from pegaflow.common.errors import DeadlineExceeded
from pegaflow.common.geometry import KVGeometry

from .format import ALIGN, HEADER_BYTES
from .gpu_plan import ReadPlan, RecordSpans, plan_reads
from .kvikio_io import check, configure, load_kvikio, open_checked
from .records import verify
from .ring import BlockHash, NsDigest, Record
from .tier import SsdTier

logger = logging.getLogger(__name__)

HASH_THREADS = 4  # xxh3 ~10-25 GB/s a core: four keep up with a fetch-back


class FetchBack(Protocol):
    """Copy device ranges (src[i], nbytes[i]) back to back into host memory
    and return a view of the first `total` bytes; done when it returns."""

    def __call__(
        self, src: np.ndarray, nbytes: np.ndarray, total: int
    ) -> memoryview: ...


class DeviceRange:
    """Raw device memory as kvikio takes it (`__cuda_array_interface__`)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


@dataclass(frozen=True, slots=True)
class DirectResult:
    ok: np.ndarray  # bool per requested block: its bytes landed and checked
    nbytes: int  # payload bytes that landed and checked
    reads: int  # payload read requests issued (after merging)
    read_s: float  # issue to the last read done
    check_s: float  # fetch-back and hashing


def _aligned(nbytes: int) -> np.ndarray:
    """Page-aligned host memory that Python owns (O_DIRECT reads of headers)."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


def open_cufiles(
    paths: Sequence[str], threads: int = 8, checked: Sequence[int] | None = None
) -> list[Any]:
    """kvikio CuFiles for reading, one per data file (imported lazily), with
    kvikio's pool as deep as `threads` and O_DIRECT for aligned reads, as the
    kvikio backend sets them (kvikio's default of one thread would serialise
    a load's reads). checked: the store's descriptors of the files, which
    they are opened through (kvikio_io.open_checked)."""
    _, defaults, cufile = load_kvikio()
    configure(defaults, threads)
    return open_checked(cufile, paths, "r", checked)


class DirectReads:
    """Direct loads from one SsdTier's files. Thread-safe: each load has its
    own buffers; the files are kvikio's (thread-safe) handles."""

    def __init__(
        self,
        tier: SsdTier,
        files: Sequence[Any] | None = None,
        hash_threads: int = HASH_THREADS,
    ) -> None:
        """files: one object per data file with kvikio's CuFile.pread
        (buf, size, file_offset) -> future with .get(); default: kvikio."""
        self._tier = tier
        if files is None:
            files = open_cufiles(
                tier.config.paths,
                max(8, tier.config.read_threads),
                tier.store.checked_fds,
            )
        self._files = list(files)
        self._hash = ThreadPoolExecutor(hash_threads, "ssd-gpu-check")

    def load(
        self,
        ns_digest: NsDigest,
        hashes: Sequence[BlockHash],
        block_ids: np.ndarray,
        geometry: KVGeometry,
        regions: list[tuple[int, int]],
        fetch: FetchBack,
        deadline: float | None = None,
    ) -> DirectResult:
        """Read block i (hashes[i]) into engine block block_ids[i]. Blocks not
        on the SSD, of another geometry, or failing a check come back False."""
        n = len(hashes)
        store = self._tier.store
        pinned = [store.pin(ns_digest, h) for h in hashes]  # one lock each
        try:
            have = np.array([r is not None for r in pinned], bool)
            recs = [r for r in pinned if r is not None]
            spans = RecordSpans(
                np.array([r.file for r in recs], np.int64),
                np.array([r.offset for r in recs], np.uint64),
                np.array([r.length for r in recs], np.uint64),
                np.array([r.payload_len for r in recs], np.uint64),
            )
            ids = np.asarray(block_ids, np.int64)[have]
            plan = plan_reads(spans, ids, geometry, regions)
            recs = [r for r, p in zip(recs, plan.planned.tolist(), strict=True) if p]
            deadlines.check(deadline, "load")
            good, read_s, check_s = self._read_and_check(recs, plan, fetch, deadline)
        finally:
            store.unpin([r for r in pinned if r is not None])
        ok = np.zeros(n, bool)
        where = np.flatnonzero(have)[plan.planned]
        ok[where] = good
        nbytes = int(good.sum()) * plan.slot_bytes
        return DirectResult(ok, nbytes, len(plan), read_s, check_s)

    def _read_and_check(
        self,
        recs: list[Record],
        plan: ReadPlan,
        fetch: FetchBack,
        deadline: float | None,
    ) -> tuple[np.ndarray, float, float]:
        k = len(recs)
        if not k:
            return np.zeros(0, bool), 0.0, 0.0
        heads = _aligned(k * HEADER_BYTES)
        start = time.perf_counter()
        if not self._read_all(recs, plan, heads, deadline):
            return np.zeros(k, bool), time.perf_counter() - start, 0.0
        mid = time.perf_counter()
        slot = plan.slot_bytes
        back = fetch(plan.back, plan.back_bytes, k * slot)
        store_id = self._tier.store.store_id

        def check_one(i: int) -> str:
            page = memoryview(heads[i * HEADER_BYTES : (i + 1) * HEADER_BYTES])
            return verify(recs[i], store_id, page, [back[i * slot : (i + 1) * slot]])

        failures = list(self._hash.map(check_one, range(k)))
        for rec, failure in zip(recs, failures, strict=True):
            if failure:  # as the L1 route's read does: it would fail there too
                self._tier.store.drop_damaged(rec, failure)
        good = np.array([not f for f in failures], bool)
        return good, mid - start, time.perf_counter() - mid

    def _read_all(
        self,
        recs: list[Record],
        plan: ReadPlan,
        heads: np.ndarray,
        deadline: float | None,
    ) -> bool:
        """Issue every header and payload read, then wait for all of them
        (even after a failure: none may still write once this returns).

        The deadline is checked before each read is issued: once it has
        passed, no further read is, and the load fails with DeadlineExceeded
        (after those in flight are done): the engine may reuse its blocks by
        then, and what did land is not reported loaded."""
        futures: list[tuple[Any, int, int]] = []
        failed: BaseException | None = None
        total = len(recs) + len(plan)

        def issue(f: Any, buf: object, nbytes: int, offset: int) -> None:
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"load: the request's deadline passed after {len(futures)} "
                    f"of {total} ssd reads were issued; no block of it is loaded"
                )
            futures.append((f.pread(buf, nbytes, offset), nbytes, offset))

        try:
            for i, rec in enumerate(recs):  # one 4 KiB header page each
                page = heads[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                issue(self._files[rec.file], page, HEADER_BYTES, rec.offset)
            rows = zip(
                plan.file.tolist(),
                plan.file_offset.tolist(),
                plan.device.tolist(),
                plan.nbytes.tolist(),
                strict=True,
            )
            for file, offset, device, nbytes in rows:
                issue(self._files[file], DeviceRange(device, nbytes), nbytes, offset)
        except BaseException as exc:  # still wait for those in flight
            failed = exc
        for fut, nbytes, offset in futures:
            try:
                check(fut.get(), nbytes, "read", offset)
            except BaseException as exc:  # wait for the rest all the same
                failed = failed or exc
        if failed is not None:
            if isinstance(failed, DeadlineExceeded) or not isinstance(
                failed, OSError | RuntimeError
            ):
                raise failed
            logger.warning("ssd direct read failed, L1 route instead: %s", failed)
            return False
        return True

    def close(self) -> None:
        self._hash.shutdown(wait=True)
        for f in self._files:
            close: Callable[[], None] | None = getattr(f, "close", None)
            if close is not None:
                close()
        self._files = []
