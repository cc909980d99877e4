"""Copy-engine batches: a descriptor table moved by `cuMemcpyBatchAsync`.

The copy engines use no SMs, so a batch they move leaves the engine's kernels
alone; which batches go here is pegaflow.copiers.cuda_copier's CopyPolicy. Two parts:

- `plan`: one compiled pass (pegaflow.kernels.table_jit): the kernels' own
  checks of the table against its buffers, then empty rows dropped, pages
  contiguous on both sides merged and copies cut at the pool's registration
  edges, into the three uint64 arrays the driver takes. No Python object per
  page; ~20 numpy calls took ~110 µs of a 1-block save on the H200.
- `MemcpyBatch`: the driver entry point called through ctypes with those
  arrays' addresses. cuda-python's binding wants a list of CUdeviceptr objects,
  about 0.5 us per page to build (7 ms for 20,480 pages on the H200).

CUDA 12.8 added the call with a `failIdx` out-argument; CUDA 13 headers map
the name to `cuMemcpyBatchAsync_v2`, the same call without it. A 13.x driver
exports both; `bind` takes `_v2` where present. libcuda is opened on first use
only (`driver()`): importing this module needs no CUDA.

Addresses are UVA pointers: an IPC-mapped device pointer for engine memory, the
pool's host address (registered with cudaHostRegister) for slots.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pegaflow.common import cuda_driver
from pegaflow.common.geometry import Transfers
from pegaflow.kernels import table_jit
from pegaflow.kernels.plan import Buffer

logger = logging.getLogger(__name__)

Direction = Literal["save", "load"]  # save: GPU -> host, load: host -> GPU
LIBCUDA = "libcuda.so.1"
MAX_BATCH = 1 << 16  # copies per driver call; a longer plan takes several calls

# cuda.h enums (CUDA 12.8+; unchanged in 13.x)
SRC_ACCESS_ORDER_STREAM = 1  # read the sources in stream order
LOCATION_DEVICE = 1
LOCATION_HOST = 2
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # a copy engine, not an SM-based copy


class MemLocation(ctypes.Structure):
    """CUmemLocation: type, then id (a union with `localized` in 13.x)."""

    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (24 bytes): one set applies to a whole batch."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    )


def attributes(direction: Direction, ordinal: int) -> MemcpyAttributes:
    """Stream-ordered sources, device and host named as they are, copy engines
    preferred over SM copies."""
    device = MemLocation(LOCATION_DEVICE, ordinal)
    host = MemLocation(LOCATION_HOST, 0)
    src, dst = (device, host) if direction == "save" else (host, device)
    return MemcpyAttributes(
        SRC_ACCESS_ORDER_STREAM, src, dst, FLAG_PREFER_OVERLAP_WITH_COMPUTE
    )


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """The driver's three arrays: copy sizes[i] bytes from srcs[i] to dsts[i].
    C-contiguous uint64, so their addresses go to the driver as they are."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    pages: int  # descriptors before merging

    def __len__(self) -> int:
        return len(self.sizes)


def plan(
    src: Buffer, dst: Buffer, t: Transfers, pool_chunks: tuple[int, int] | None = None
) -> BatchPlan:
    """Check `t` against its buffers, then merge it into as few copies as the
    addresses allow (order kept; no copy of the batch depends on another, as
    destinations are disjoint). Raises InternalError as the kernels do.

    pool_chunks: (the pool's base, the bytes of each cudaHostRegister chunk):
    no copy spans two registrations (merged runs, or a slot of a slab size
    that does not divide the chunk, are cut at the chunk edge); the pool is
    the host side, src for a load and dst for a save."""
    table_jit.checked_table(src, dst, t)  # the kernels' checks, or their error
    base, chunk = pool_chunks if pool_chunks is not None else (0, 0)
    pool_is_dst = dst.address <= base < dst.address + dst.nbytes
    dsts, srcs, sizes = table_jit.merge_cut(t, pool_is_dst, base, chunk)
    return BatchPlan(dsts, srcs, sizes, len(t))


_ARGS = (
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
)


class MemcpyBatch:
    """cuMemcpyBatchAsync over a BatchPlan: one driver call per MAX_BATCH
    copies, every call with one attribute set. ctypes drops the GIL for the
    call; the copies run after it returns, in stream order."""

    def __init__(self, fn: Any, fail_index: bool, max_batch: int = MAX_BATCH):
        self._fn = fn
        self._fail_index = fail_index
        self._max = max_batch

    def __call__(self, p: BatchPlan, attrs: MemcpyAttributes, stream: int) -> None:
        first = (ctypes.c_size_t * 1)(0)  # attrs[0] applies from copy 0 on
        failed = ctypes.c_size_t(0)
        for lo in range(0, len(p), self._max):
            count = min(self._max, len(p) - lo)
            args: list[Any] = [
                p.dsts.ctypes.data + 8 * lo,
                p.srcs.ctypes.data + 8 * lo,
                p.sizes.ctypes.data + 8 * lo,
                count,
                ctypes.addressof(attrs),
                ctypes.addressof(first),
                1,
            ]
            if self._fail_index:
                args.append(ctypes.addressof(failed))
            status = self._fn(*args, stream)
            if status:
                where = f", copy {lo + failed.value}" if self._fail_index else ""
                cuda_driver.check(
                    (cuda_driver.driver_status(status),),
                    f"cuMemcpyBatchAsync({count} copies from {lo}{where})",
                )
        logger.debug("copy-engine batch: %d copies of %d pages", len(p), p.pages)


def bind(lib: Any, max_batch: int = MAX_BATCH) -> MemcpyBatch:
    """The batch call of `lib` (ctypes.CDLL of libcuda, or a stand-in with the
    same attributes): `cuMemcpyBatchAsync_v2` (CUDA 13), else the 12.8 call."""
    fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    fail_index = fn is None
    if fn is None:
        fn = getattr(lib, "cuMemcpyBatchAsync", None)
    if fn is None:
        raise cuda_driver.CudaError(
            "cuMemcpyBatchAsync: not in this driver (needs CUDA 12.8+); "
            "give --copy-path kernel"
        )
    extra = (ctypes.c_void_p,) if fail_index else ()  # size_t *failIdx
    fn.argtypes = [*_ARGS, *extra, ctypes.c_void_p]  # ..., CUstream hStream
    fn.restype = ctypes.c_int
    return MemcpyBatch(fn, fail_index, max_batch)


@functools.cache
def driver() -> MemcpyBatch:
    """The real driver's batch call, opened once per process."""
    try:
        lib = ctypes.CDLL(LIBCUDA)
    except OSError as exc:
        raise cuda_driver.CudaError(f"{LIBCUDA}: {exc}") from exc
    return bind(lib)
