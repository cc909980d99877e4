"""CUDA copy kernels (numba): one launch moves a whole descriptor table.

Pointers: numba kernels cannot cast an integer to a pointer, but a kernel
compiled with an explicit signature takes `CPointer` arguments as plain
integers. The wrapper passes each buffer's device address (as uint8* and as
uint64*) and descriptors as byte offsets from those bases, after checking every
range against its buffer. No DeviceNDArray is built, which also skips numba's
per-array argument marshalling (about 10 us per array per launch); after the
first launch on a stream even numba's dispatch is skipped (the driver's
cuLaunchKernel, pegaflow.kernels.driver_launch). Mapped
pinned host memory (the pool) is reached through its device alias
(`cuMemHostGetDevicePointer`) while descriptors keep naming it by host address.
The simulator runs the same kernel source on numpy-backed arrays instead.

The descriptor table lives in mapped pinned memory that the kernel reads
directly (three words per descriptor, one thread each), so a launch needs no
upload: numba's copy_to_device plus slicing cost ~190 us per call, more than
the kernel for a one-block save. Two tables per stream are used in turn; an
event after each launch guards its table's reuse. Tables are checked, split
and written there by numba-compiled loops (pegaflow.kernels.table_jit), not
by numpy calls.

Kernel: each CUDA block takes one descriptor (grid-stride over the table);
small requests are cut into 16-byte-multiple pieces first so they still cover
every SM. When source and destination agree modulo 16 the body moves 16-byte
vectors (`ld/st.v2.u64`, inline PTX: numba has no vector loads), modulo 8
plain 8-byte words, otherwise bytes; head and tail bytes go byte-wise.
Consecutive threads take consecutive words, so a warp's store is one contiguous
stretch: GPU.md measured that this decides the speed over PCIe (a thread
writing two words 16 bytes apart was 10x slower). Four loads are issued before
four stores to keep more reads in flight when they cross PCIe. On the H200
(benchmarks/RESULTS.md, "copy strategies compared (issue 12)") this kernel
ran at 0.89-0.92 of one contiguous memcpy from 64 blocks up, and a
warp-per-piece kernel (since deleted; git keeps it), other thread counts,
8-byte words and capped grids did not beat it there.

numpy >= 2.5 dropped `numpy.row_stack`, which numba-cuda 0.30 still registers
at import: alias it to `vstack` (the same function) before importing numba.cuda.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

import numpy as np

if not hasattr(np, "row_stack"):  # numpy >= 2.5 vs numba-cuda 0.30, see above
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402
from numba.cuda import types  # noqa: E402
from numba.cuda.core import config  # noqa: E402

from pegaflow.common.cuda_driver import check  # noqa: E402 - the one status check
from pegaflow.common.errors import CopyFailed, InternalError  # noqa: E402
from pegaflow.common.geometry import Transfers  # noqa: E402

from . import table_jit  # noqa: E402
from .base import CopyKernels  # noqa: E402
from .driver_launch import DriverLaunch  # noqa: E402
from .launch_state import StreamTables  # noqa: E402
from .plan import Buffer, aligned_empty, check_buffer

logger = logging.getLogger(__name__)

SIMULATED = bool(config.ENABLE_CUDASIM)
# Small grids are deliberate here (one block per descriptor, or an SM cap):
# numba's "grid size < 128" warning would fire on every small save.
config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
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
    "scatter",
    "staging_buffer",
    "stream",
    "synchronize",
    "wrap",
    "wrap_array",
]


def _load16_sim(a: Any, i: int) -> tuple[int, int]:
    return a[i], a[i + 1]


def _store16_sim(a: Any, i: int, v: tuple[int, int]) -> None:
    a[i], a[i + 1] = v


def _vector_intrinsics() -> tuple[Any, Any]:
    """16-byte load/store of words i, i+1 behind a uint64 pointer, inline PTX."""
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    i64 = ir.IntType(64)
    pair = types.UniTuple(types.uint64, 2)

    def pointer(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any) -> Any:
        return builder.gep(ary, [idx])  # the kernel only ever gets CPointers

    @intrinsic
    def load16(typingctx: Any, ary: Any, idx: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = pointer(context, builder, sig.args[0], args[0], args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([i64, i64]), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.v2.u64 {$0, $1}, [$2];", "=l,=l,l", True)
            got = builder.call(asm, [ptr])
            out = cgutils.get_null_value(context.get_value_type(pair))
            for k in range(2):
                out = builder.insert_value(out, builder.extract_value(got, k), k)
            return out

        return pair(ary, idx), codegen

    @intrinsic
    def store16(typingctx: Any, ary: Any, idx: Any, val: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> None:
            ptr = pointer(context, builder, sig.args[0], args[0], args[1])
            lo, hi = (builder.extract_value(args[2], k) for k in range(2))
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i64, i64])
            asm = ir.InlineAsm(fnty, "st.v2.u64 [$0], {$1, $2};", "l,l,l", True)
            builder.call(asm, [ptr, lo, hi])

        return types.void(ary, idx, pair), codegen

    return load16, store16


if SIMULATED:  # the simulator runs Python: the same two words, one at a time
    load16, store16 = _load16_sim, _store16_sim
else:
    load16, store16 = _vector_intrinsics()


@cuda.jit(device=True)
def _bytes(src: Any, dst: Any, s: int, t: int, n: int, tid: int, step: int) -> None:
    for i in range(tid, n, step):
        dst[t + i] = src[s + i]


@cuda.jit(device=True)
def _words(src: Any, dst: Any, s: int, t: int, n: int, tid: int, step: int) -> None:
    i = tid
    while i + 3 * step < n:
        a = src[s + i]
        b = src[s + i + step]
        c = src[s + i + 2 * step]
        e = src[s + i + 3 * step]
        dst[t + i] = a
        dst[t + i + step] = b
        dst[t + i + 2 * step] = c
        dst[t + i + 3 * step] = e
        i += 4 * step
    while i < n:
        dst[t + i] = src[s + i]
        i += step


@cuda.jit(device=True)
def _pairs(src: Any, dst: Any, s: int, t: int, n: int, tid: int, step: int) -> None:
    """n 16-byte vectors; s and t are (even) word indexes."""
    i = tid
    while i + 3 * step < n:
        a = load16(src, s + 2 * i)
        b = load16(src, s + 2 * (i + step))
        c = load16(src, s + 2 * (i + 2 * step))
        e = load16(src, s + 2 * (i + 3 * step))
        store16(dst, t + 2 * i, a)
        store16(dst, t + 2 * (i + step), b)
        store16(dst, t + 2 * (i + 2 * step), c)
        store16(dst, t + 2 * (i + 3 * step), e)
        i += 4 * step
    while i < n:
        store16(dst, t + 2 * i, load16(src, s + 2 * i))
        i += step


def _copy_body(
    src8: Any,
    dst8: Any,
    src64: Any,
    dst64: Any,
    table: Any,
    count: int,
    cap: int,
    width: int,
) -> None:
    """table[r * cap + d]: row r (src offset, dst offset, nbytes) of descriptor d."""
    desc = cuda.shared.array(3, types.int64)
    tid = cuda.threadIdx.x
    step = cuda.blockDim.x
    d = cuda.blockIdx.x
    while d < count:  # every thread of a block shares d: no divergence
        if tid < 3:
            desc[tid] = table[tid * cap + d]  # three reads over PCIe, in parallel
        cuda.syncthreads()
        s, t, n = desc[0], desc[1], desc[2]
        cuda.syncthreads()  # all have read desc before it is overwritten
        if width > 1 and (s & 7) == (t & 7):
            head = min((8 - (s & 7)) & 7, n)
            _bytes(src8, dst8, s, t, head, tid, step)
            s, t, n = s + head, t + head, n - head
            if width == 16 and (s & 15) == (t & 15) and n >= 16:
                if s & 15:  # one word up to the 16-byte boundary
                    if tid == 0:
                        dst64[t >> 3] = src64[s >> 3]
                    s, t, n = s + 8, t + 8, n - 8
                vecs = n >> 4
                _pairs(src64, dst64, s >> 3, t >> 3, vecs, tid, step)
                s, t, n = s + 16 * vecs, t + 16 * vecs, n - 16 * vecs
            words = n >> 3
            _words(src64, dst64, s >> 3, t >> 3, words, tid, step)
            s, t, n = s + 8 * words, t + 8 * words, n - 8 * words
        _bytes(src8, dst8, s, t, n, tid, step)
        d += cuda.gridDim.x


@functools.cache
def _kernel() -> Any:
    """Compiled on first use (about a second), once per process."""
    if SIMULATED:
        return cuda.jit(_copy_body)
    u8, u64, i64 = (types.CPointer(x) for x in (types.uint8, types.uint64, types.int64))
    sig = types.void(u8, u8, u64, u64, i64, types.int64, types.int64, types.int64)
    return cuda.jit(sig)(_copy_body)


# -- host side ---------------------------------------------------------------
def _device_alias(address: int) -> int:
    """Device address of mapped (registered or host-allocated) pinned memory."""
    from cuda.bindings import driver

    cuda.current_context()  # the driver call needs a current context
    try:
        return int(check(driver.cuMemHostGetDevicePointer(address, 0), "map"))
    except CopyFailed as e:
        raise InternalError(f"address: {address:#x} is not mapped pinned: {e}") from e


def wrap(
    address: int, nbytes: int, *, mapped: bool = False, owner: Any = None
) -> Buffer:
    """A buffer over `nbytes` at `address`: device memory, or with `mapped`
    pinned host memory that descriptors name by its host address."""
    if SIMULATED:  # simulated device memory is host memory
        from .cpu import wrap as host_wrap

        b = host_wrap(address, nbytes, owner=owner)
        fake = cuda.cudadrv.devicearray.FakeCUDAArray  # wraps, never copies
        words = b.data[: nbytes // 8 * 8].view(np.uint64)
        return Buffer(address, address, nbytes, fake(b.data), fake(words), b.owner)
    check_buffer(address, address, nbytes)
    dev = _device_alias(address) if mapped else address
    check_buffer(address, dev, nbytes)
    return Buffer(address, dev, nbytes, None, None, owner)


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
    if SIMULATED:
        host = aligned_empty(nbytes)
        return wrap(host.ctypes.data, nbytes, owner=host)
    return wrap_array(cuda.device_array(nbytes, np.uint8))


def stream() -> Any:
    """A new stream in numba's (primary) context; torch shares that context."""
    return cuda.stream()


def synchronize(stream: Any) -> None:
    """Wait for the stream; a fault in a kernel or copy surfaces here."""
    if SIMULATED:
        return
    from numba.cuda.cudadrv.driver import CudaAPIError

    try:
        stream.synchronize()
    except CudaAPIError as e:
        raise CopyFailed(f"stream: {e}") from e


@functools.cache
def _default_blocks() -> int:
    """A grid that fills every SM with THREADS-thread blocks."""
    if SIMULATED:
        return SIM_BLOCKS
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return sms * max(1, SM_THREADS // THREADS)


class _Table:
    """A descriptor table in mapped pinned memory, and the event after the
    last launch that reads it."""

    def __init__(self, rows: int) -> None:
        self.cap = max(TABLE_MIN_ROWS, 1 << (rows - 1).bit_length())
        self.mem = cuda.mapped_array(3 * self.cap, np.int64)
        # A plain ndarray view: the compiled planner writes into it.
        self.rows = np.asarray(self.mem).reshape(3, self.cap)
        self.done = cuda.event() if SIMULATED else cuda.event(timing=False)
        self.ptr = 0 if SIMULATED else self.mem.device_ctypes_pointer.value


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
        self._launch_call: Any = None  # the kernel's launch, made on first use
        table_jit.compiled()  # compiled or loaded now, not on the first copy

    def _launcher(self) -> Any:
        """(blocks, threads, stream, args) -> None for the kernel: the
        driver's cuLaunchKernel (pegaflow.kernels.driver_launch), numba's own
        dispatch under the simulator."""
        launch = self._launch_call
        if launch is None:
            kernel = _kernel()
            if SIMULATED:

                def launch(blocks: int, threads: int, stream: Any, args: tuple) -> None:
                    kernel[blocks, threads, stream](*args)

            else:
                launch = DriverLaunch(kernel, 8)
            self._launch_call = launch
        return launch

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
    ) -> None:
        rows = SIM_SPLIT_ROWS if SIMULATED else _default_blocks()
        n, piece = table_jit.split_rows(table, rows, MIN_PIECE)
        if not n:
            return
        blocks = min(n, max_blocks or _default_blocks())
        launch = self._launcher()
        mine = self._tables(stream)
        with mine.lock:  # table choice, fill and launch: one thread at a time
            tab = mine.next(n, _Table)
            table_jit.write_split(table, piece, tab.rows)
            if SIMULATED:
                args = (src.data, dst.data, src.words, dst.words, tab.mem)
            else:
                a, b = src.device_address, dst.device_address
                args = (a, b, a, b, tab.ptr)
            launch(blocks, THREADS, stream, (*args, n, tab.cap, width))
            tab.done.record(stream)
        logger.debug("copy %d descriptors, %d blocks", n, blocks)

    def _checked(self, src: Buffer, dst: Buffer, t: Transfers) -> np.ndarray:
        """The numpy checks as one compiled call (pegaflow.kernels.table_jit):
        ~20 numpy calls were ~100 µs of a 1-block copy on the H200."""
        return table_jit.checked_table(src, dst, t)


_kernels = CudaKernels()
copy_descriptors = _kernels.copy_descriptors
gather = _kernels.gather
scatter = _kernels.scatter
