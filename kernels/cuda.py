"""CUDA copy kernels, host side: one launch moves a whole descriptor table.

The kernel itself is pegaflow.kernels.copy_kernel (numba device code); on a
GPU its cubin is loaded and launched through the driver
(pegaflow.kernels.device_driver), under numba's simulator it runs as a numba
kernel (pegaflow.kernels.device_sim, NUMBA_ENABLE_CUDASIM=1). This module is
the same for both: buffers, the checked and split descriptor table, and the
launch. Importing it on a GPU host imports no numba-cuda; a warm restart
loads the kernel from pegaflow.kernels.cubin_cache.

Descriptors are byte offsets from each buffer's base, checked against it
first; mapped pinned host memory (the pool) is reached through its device
alias (`cudaHostGetDevicePointer`) while descriptors keep naming it by host
address.

The descriptor table lives in mapped pinned memory that the kernel reads
directly (three words per descriptor, one thread each), so a launch needs no
upload: numba's copy_to_device plus slicing cost ~190 us per call, more than
the kernel for a one-block save. Two tables per stream are used in turn; an
event after each launch guards its table's reuse. Tables are checked, split
and written there by numba-compiled CPU loops (pegaflow.kernels.table_jit),
not by numpy calls.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import Transfers

from . import table_jit
from .base import CopyKernels
from .launch_state import StreamTables
from .plan import Buffer, descriptor_table, split_table


def _simulator_on() -> bool:
    """numba's own switch (NUMBA_ENABLE_CUDASIM, an integer), read without
    importing numba."""
    try:
        return int(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") or 0) != 0
    except ValueError:
        return False


SIMULATED = _simulator_on()
if SIMULATED:
    from . import device_sim as device
else:
    from . import device_driver as device

logger = logging.getLogger(__name__)

# The simulator runs one Python thread per CUDA thread: keep its blocks small.
THREADS = 32 if SIMULATED else 256
SM_THREADS = 2048  # resident threads per SM (sm_90): a full grid fills them
SIM_BLOCKS = 4
# Split descriptors of small requests into pieces of >= MIN_PIECE bytes until
# the table has a full grid's worth of rows (the simulator: a few, to test it).
MIN_PIECE = 64 if SIMULATED else 4096
SIM_SPLIT_ROWS = 8
TABLE_MIN_ROWS = 1024

__all__ = [
    "copy_descriptors",
    "gather",
    "mapped_buffer",
    "scatter",
    "staging_buffer",
    "stream",
    "synchronize",
    "wrap",
    "wrap_array",
]


# -- host side ---------------------------------------------------------------
def wrap(
    address: int, nbytes: int, *, mapped: bool = False, owner: Any = None
) -> Buffer:
    """A buffer over `nbytes` at `address`: device memory, or with `mapped`
    pinned host memory that descriptors name by its host address."""
    return device.wrap(address, nbytes, mapped, owner)


def wrap_array(obj: Any) -> Buffer:
    """A buffer over a contiguous CUDA array (torch tensor, DeviceNDArray) or a
    numpy array in mapped pinned memory."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None and isinstance(obj, np.ndarray) and obj.flags.c_contiguous:
        return wrap(obj.ctypes.data, obj.nbytes, mapped=True, owner=obj)
    if cai is None or cai.get("strides") is not None:
        raise InternalError("array: need a contiguous CUDA or mapped numpy array")
    nbytes = int(np.prod(cai["shape"])) * np.dtype(cai["typestr"]).itemsize
    return wrap(cai["data"][0], nbytes, owner=obj)


def staging_buffer(nbytes: int) -> Buffer:
    """`nbytes` of device scratch memory to copy within."""
    return device.staging_buffer(nbytes)


def mapped_buffer(nbytes: int) -> Buffer:
    """`nbytes` of pinned host memory the GPU writes directly (zero-copy),
    named by its host address; freed with the buffer's owner."""
    return device.mapped_buffer(nbytes)


def stream() -> Any:
    """A new stream in the current device's primary context (torch shares
    it); `.handle` is the CUstream as an integer."""
    return device.stream()


def synchronize(stream: Any) -> None:
    """Wait for the stream; a fault in a kernel or copy surfaces here
    (CopyFailed naming the CUDA error)."""
    device.synchronize(stream)


@functools.cache
def _default_blocks() -> int:
    """A grid that fills every SM with THREADS-thread blocks (the first
    device asked: the servers' GPUs are one model)."""
    if SIMULATED:
        return SIM_BLOCKS
    return device.sm_count() * max(1, SM_THREADS // THREADS)


def _table(rows: int) -> Any:
    """A stream's descriptor table for at least `rows` (a power of two)."""
    return device.Table(max(TABLE_MIN_ROWS, 1 << (rows - 1).bit_length()))


class CudaKernels(CopyKernels):
    """The hook: one kernel launch per table."""

    def __init__(self) -> None:
        # Per stream object, not its handle: a destroyed stream's handle value
        # may come back for a stream of another context, whose kernels could
        # not read these tables' device pointers.
        self._streams: weakref.WeakKeyDictionary[Any, StreamTables] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()  # guards the dict of streams only
        table_jit.load_in_background()  # numpy twins meanwhile (_checked, _launch)

    def _tables(self, stream: Any) -> StreamTables:
        with self._lock:
            mine = self._streams.get(stream)
            if mine is None:
                mine = self._streams[stream] = StreamTables()
            return mine

    def _launch(
        self,
        src: Buffer,
        dst: Buffer,
        table: np.ndarray,
        stream: Any,
        max_blocks: int | None,
        width: int,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        rows = SIM_SPLIT_ROWS if SIMULATED else _default_blocks()
        if table_jit.ready():
            n, piece = table_jit.split_rows(table, rows, MIN_PIECE)
            split = None
        else:  # the compiled loops still loading (a start): their numpy twin
            split = split_table(table, rows, MIN_PIECE)
            n, piece = split.shape[1], 0
        if before_launch is not None and not n:
            before_launch()  # the caller's event still brackets nothing
        if not n:
            return
        blocks = min(n, max_blocks or _default_blocks())
        mine = self._tables(stream)
        with mine.lock:  # table choice, fill and launch: one thread at a time
            tab = mine.next(n, _table)
            if split is None:
                table_jit.write_split(table, piece, tab.rows)
            else:
                tab.rows[:, :n] = split
            if before_launch is not None:
                before_launch()
            device.launch(blocks, THREADS, stream, src, dst, tab, n, width)
            tab.done.record(stream)
        logger.debug("copy %d descriptors, %d blocks", n, blocks)

    def _checked(self, src: Buffer, dst: Buffer, t: Transfers) -> np.ndarray:
        """The numpy checks as one compiled call (pegaflow.kernels.table_jit):
        ~20 numpy calls were ~100 µs of a 1-block copy on the H200. Until
        the compiled loops are loaded, the numpy checks themselves."""
        if table_jit.ready():
            return table_jit.checked_table(src, dst, t)
        return descriptor_table(src, dst, t)


_kernels = CudaKernels()
copy_descriptors = _kernels.copy_descriptors
gather = _kernels.gather
scatter = _kernels.scatter
