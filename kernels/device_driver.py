"""The GPU half of pegaflow.kernels.cuda on cuda-python alone: streams,
events, mapped descriptor tables, and the copy kernel loaded from its cubin
(pegaflow.kernels.cubin_cache) and launched by cuLaunchKernel. numba-cuda is
imported only to compile that cubin when no cached one fits; a restarted
server with a warm cache never imports it.

Everything runs on the current thread's context, the device's primary one
(pegaflow.common.cuda_driver.set_device; torch and the IPC mappings use it
too). The kernel module is loaded once per context. Each stream keeps its own
parameter buffer: the driver copies the parameters during cuLaunchKernel,
which cuda-python calls without the GIL, so a buffer shared by two streams
could be refilled by one thread's launch while another's still reads it.
Launches on one stream are serialised by its caller (the stream's table
lock in pegaflow.kernels.cuda).

Launch cost: numba's dispatch took ~20-30 us more than cuLaunchKernel per
launch on the H200 (benchmarks/RESULTS.md, 2026-12-02: 71-85 us against 54-56
for a 1-block copy).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import weakref
from typing import Any

import numpy as np
from cuda.bindings import driver as dr
from cuda.bindings import runtime as rt

from pegaflow.common.cuda_driver import CudaError, check
from pegaflow.common.errors import CopyFailed, InternalError

from . import cubin_cache
from .plan import Buffer, check_buffer

logger = logging.getLogger(__name__)

PARAMS = 8  # the kernel's parameters (pegaflow.kernels.copy_kernel), 8 bytes each
_MAPPED = rt.cudaHostAllocMapped | rt.cudaHostAllocPortable


def _quiet(call: Any, *args: Any) -> None:
    """A release at collection or exit: nothing to raise to."""
    with contextlib.suppress(Exception):  # the driver may be gone at exit
        call(*args)


# -- the kernel, per context ----------------------------------------------------
_functions: dict[int, tuple[Any, Any]] = {}  # context handle -> (module, function)
_functions_lock = threading.Lock()


def _arch() -> str:
    device = check(rt.cudaGetDevice(), "cudaGetDevice")
    attr = rt.cudaDeviceAttr
    major = check(
        rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device),
        "compute capability",
    )
    minor = check(
        rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device),
        "compute capability",
    )
    return f"sm_{major}{minor}"


def _compile() -> tuple[bytes, str]:
    from . import copy_kernel  # imports numba-cuda: ~1.5 s, then ~1 s to compile

    return copy_kernel.image()


def _load(cubin: bytes, entry: str) -> tuple[Any, Any]:
    module = check(dr.cuModuleLoadData(cubin), "cuModuleLoadData")
    try:
        return module, check(
            dr.cuModuleGetFunction(module, entry.encode()), "cuModuleGetFunction"
        )
    except CudaError:
        _quiet(dr.cuModuleUnload, module)
        raise


def kernel_function() -> Any:
    """The copy kernel's CUfunction in the current context (loaded on first
    use: from the cache, or compiled)."""
    check(rt.cudaFree(0), "cudaFree")  # the device's primary context, current
    ctx = int(check(dr.cuCtxGetCurrent(), "cuCtxGetCurrent"))
    if not ctx:
        raise InternalError("no current CUDA context: set_device before the kernels")
    with _functions_lock:
        known = _functions.get(ctx)
        if known is None:
            arch = _arch()
            try:
                known = _load(*cubin_cache.load_or_compile(arch, _compile))
            except CudaError as exc:  # a cached image the driver refuses
                logger.warning("cached copy kernel refused (%s): compiling", exc)
                known = _load(*cubin_cache.load_or_compile(arch, _compile, fresh=True))
            _functions[ctx] = known
        return known[1]


# -- streams, events, memory -------------------------------------------------------
class Stream:
    """A stream of the current context, its copy kernel and its launch
    parameters. `handle` is the CUstream as an integer (what the copy engine
    passes to other driver calls). Driver calls only, as numba made them
    (cuStreamCreate(0): ordered after the legacy default stream)."""

    __slots__ = ("__weakref__", "_function", "_params", "_values", "handle", "raw")

    def __init__(self) -> None:
        self._function = kernel_function()
        self.raw = check(dr.cuStreamCreate(0), "cuStreamCreate")
        self.handle = int(self.raw)
        weakref.finalize(self, _quiet, dr.cuStreamDestroy, self.raw)
        self._values = np.zeros(PARAMS, np.uint64)
        base = np.uint64(self._values.ctypes.data)
        pointers = np.arange(PARAMS, dtype=np.uint64) * np.uint64(8) + base
        self._params = (pointers, int(pointers.ctypes.data))

    def launch(self, blocks: int, threads: int, args: tuple[int, ...]) -> None:
        self._values[:] = args
        check(
            dr.cuLaunchKernel(
                self._function, blocks, 1, 1, threads, 1, 1, 0, self.raw,
                self._params[1], 0,
            ),
            "kernel launch",
        )  # fmt: skip

    def synchronize(self) -> None:
        check(dr.cuStreamSynchronize(self.raw), "stream")


class Event:
    """An event without timing: guards a descriptor table's reuse."""

    __slots__ = ("__weakref__", "_raw")

    def __init__(self) -> None:
        flags = dr.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._raw = check(dr.cuEventCreate(flags), "cuEventCreate")
        weakref.finalize(self, _quiet, dr.cuEventDestroy, self._raw)

    def record(self, stream: Stream) -> None:
        check(dr.cuEventRecord(self._raw, stream.raw), "cuEventRecord")

    def synchronize(self) -> None:
        check(dr.cuEventSynchronize(self._raw), "cuEventSynchronize")


class MappedHost:
    """Pinned host memory the GPU reaches (cudaHostAlloc, mapped, portable)."""

    __slots__ = ("__weakref__", "address", "array", "device_address", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.address = int(check(rt.cudaHostAlloc(nbytes, _MAPPED), "cudaHostAlloc"))
        weakref.finalize(self, _quiet, rt.cudaFreeHost, self.address)
        self.nbytes = nbytes
        self.array = np.ctypeslib.as_array(
            (ctypes.c_uint8 * nbytes).from_address(self.address)
        )
        self.device_address = _device_alias(self.address)


class Table:
    """A descriptor table (three int64 rows of `cap`) in mapped pinned memory
    that the kernel reads directly, and the event after its last launch."""

    __slots__ = ("arg", "cap", "done", "mem", "rows")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.mem = MappedHost(3 * 8 * self.cap)
        self.rows = self.mem.array.view(np.int64).reshape(3, self.cap)
        self.done = Event()
        self.arg = self.mem.device_address


def _device_alias(address: int) -> int:
    """Device address of mapped (registered or host-allocated) pinned memory."""
    try:
        return int(check(rt.cudaHostGetDevicePointer(address, 0), "map"))
    except CopyFailed as e:
        raise InternalError(f"address: {address:#x} is not mapped pinned: {e}") from e


class _DeviceMemory:
    __slots__ = ("__weakref__", "address")

    def __init__(self, nbytes: int) -> None:
        self.address = int(check(rt.cudaMalloc(nbytes), "cudaMalloc"))
        weakref.finalize(self, _quiet, rt.cudaFree, self.address)


# -- the backend's device calls (pegaflow.kernels.cuda) -----------------------------
def wrap(address: int, nbytes: int, mapped: bool, owner: Any) -> Buffer:
    check_buffer(address, address, nbytes)
    dev = _device_alias(address) if mapped else address
    check_buffer(address, dev, nbytes)
    return Buffer(address, dev, nbytes, None, None, owner)


def staging_buffer(nbytes: int) -> Buffer:
    memory = _DeviceMemory(nbytes)
    return wrap(memory.address, nbytes, False, memory)


def mapped_buffer(nbytes: int) -> Buffer:
    memory = MappedHost(nbytes)
    return Buffer(memory.address, memory.device_address, nbytes, None, None, memory)


def stream() -> Stream:
    return Stream()


def synchronize(stream: Stream) -> None:
    stream.synchronize()


def launch(
    blocks: int, threads: int, stream: Stream, src: Buffer, dst: Buffer,
    tab: Table, n: int, width: int,
) -> None:  # fmt: skip
    a, b = src.device_address, dst.device_address
    stream.launch(blocks, threads, (a, b, a, b, tab.arg, n, tab.cap, width))


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    device = check(rt.cudaGetDevice(), "cudaGetDevice")
    attr = rt.cudaDeviceAttr.cudaDevAttrMultiProcessorCount
    return int(check(rt.cudaDeviceGetAttribute(attr, device), "SM count"))
