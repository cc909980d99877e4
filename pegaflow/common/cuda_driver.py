"""The CUDA driver work of the GPU data path, over cuda-python (`cuda.bindings`).

Everything here imports `cuda.bindings` lazily, inside the functions: the server
imports this module on machines without any CUDA and only calls into it once a
GPU stack was found (`probe`). Every status goes through `check()`.

The runtime API is used where it names what we do (cudaIpc*, cudaHostRegister):
it works on each device's primary context, which is also the context numba and
torch use, so pointers opened here are valid in pegaflow.kernels' launches.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import CopyFailed
from .keys import IPC_HANDLE_BYTES

logger = logging.getLogger(__name__)

REGISTER_CHUNK = 64 << 30  # cudaHostRegister is refused (or slow) past this
# The pool's chunks: pinned from 8 threads, 64 GiB in 8 GiB chunks came up at
# 16.8 GB/s on the H200 host, against 5.9 GB/s for one cudaHostRegister call;
# 1 GiB chunks keep all 8 threads busy for pools under 64 GiB too. The copy
# engines' batches are cut at these edges (pegaflow.copiers.dma.plan).
POOL_CHUNK_BYTES = 1 << 30
POOL_CHUNK_THREADS = 8
_VMM_HINT = (
    "memory from the CUDA VMM API (PyTorch expandable_segments, vLLM sleep mode) "
    "cannot be shared with cudaIpcGetMemHandle: start the engine without "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and without "
    "--enable-sleep-mode"
)


class CudaError(CopyFailed):
    """A CUDA call failed; the message names the call and the CUDA error."""


def _rt() -> Any:
    from cuda.bindings import runtime

    return runtime


def _dr() -> Any:
    from cuda.bindings import driver

    return driver


def _error_name(err: Any) -> str:
    try:
        if type(err).__name__ == "CUresult":
            name = _dr().cuGetErrorName(err)[1]
        else:
            name = _rt().cudaGetErrorName(err)[1]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming an error must never raise
        return str(err)


def driver_status(code: int) -> Any:
    """A driver status from a ctypes call (a plain int) as check() names it."""
    try:
        return _dr().CUresult(code)
    except (ImportError, ValueError):  # no cuda-python, or a code it lacks
        return code


# Faults after which a CUDA context stays broken until the process exits: CUDA
# returns the same error from every later call (its "sticky" errors), runtime
# and driver names both (numba's messages carry the driver's).
_STICKY_PAIRS = (  # (runtime name after cudaError, driver name after CUDA_ERROR_)
    ("IllegalAddress", "ILLEGAL_ADDRESS"),
    ("LaunchFailure", "LAUNCH_FAILED"),
    ("IllegalInstruction", "ILLEGAL_INSTRUCTION"),
    ("MisalignedAddress", "MISALIGNED_ADDRESS"),
    ("InvalidAddressSpace", "INVALID_ADDRESS_SPACE"),
    ("InvalidPc", "INVALID_PC"),
    ("HardwareStackError", "HARDWARE_STACK_ERROR"),
    ("Assert", "ASSERT"),
    ("ECCUncorrectable", "ECC_UNCORRECTABLE"),
    ("LaunchTimeout", "LAUNCH_TIMEOUT"),
)
STICKY = tuple(
    name
    for runtime, drv in _STICKY_PAIRS
    for name in (f"cudaError{runtime}", f"CUDA_ERROR_{drv}")
)


def sticky_error(exc: BaseException) -> str | None:
    """The sticky CUDA error an exception's message names, if any."""
    text = str(exc)
    return next((name for name in STICKY if name in text), None)


def check(result: Any, what: str) -> Any:
    """The one place a CUDA status (runtime or driver) becomes an exception.

    `result` is what a cuda.bindings call returns: (status, *values). Returns
    the single value, a tuple of several, or None.
    """
    parts = result if isinstance(result, tuple) else (result,)
    err = parts[0]
    if int(err) != 0:
        raise CudaError(f"{what}: {_error_name(err)}")
    values = parts[1:]
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _to_bytes(handle: Any) -> bytes:
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _from_bytes(cls: Any, data: bytes) -> Any:
    # cuda.bindings structs expose no byte field: copy into the struct itself.
    if len(data) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(data)}")
    handle = cls()
    ctypes.memmove(handle.getPtr(), data, IPC_HANDLE_BYTES)
    return handle


# -- devices ------------------------------------------------------------------
CUDA_EXTRA = 'pip install "pegaflow-py[cuda]" (cuda-bindings, numba-cuda)'


def hint(exc: BaseException) -> str:
    """What to do about a GPU stack that did not load: the missing extra, or
    the driver; host engines need neither (--devices none)."""
    if isinstance(exc, ImportError):
        return f"install the cuda extra: {CUDA_EXTRA}, or give --devices none"
    return "is the NVIDIA driver loaded (nvidia-smi)? or give --devices none"


def probe(ordinals: Sequence[int] | None) -> list[int]:
    """The CUDA devices to serve: `ordinals`, or every visible one when None.

    Returns [] when no GPU stack is present and none was asked for; raises
    CudaError when asked-for devices are missing.
    """
    try:
        rt = _rt()
        count = check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
    except (ImportError, OSError, RuntimeError, CudaError) as exc:
        if ordinals:
            raise CudaError(f"--devices: no usable CUDA ({exc}); {hint(exc)}") from exc
        logger.info("no CUDA GPU stack (%s); serving host engines only", exc)
        return []
    wanted = list(range(count)) if ordinals is None else list(ordinals)
    missing = [d for d in wanted if not 0 <= d < count]
    if missing:
        raise CudaError(f"--devices: {missing} not among the {count} visible GPUs")
    return wanted


def set_device(ordinal: int) -> None:
    """Make the device's primary context current in this thread."""
    check(_rt().cudaSetDevice(ordinal), f"cudaSetDevice({ordinal})")


def device_uuid(ordinal: int) -> bytes:
    dr = _dr()
    check(dr.cuInit(0), "cuInit")
    dev = check(dr.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    return bytes(check(dr.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes)


# -- engine side: export -------------------------------------------------------
def allocation_of(pointer: int) -> tuple[int, int]:
    """(base, size) of the cudaMalloc allocation holding `pointer`.

    Refuses VMM memory (cuMemCreate/cuMemMap: PyTorch expandable_segments, vLLM
    sleep mode): cudaIpcGetMemHandle cannot export it.
    """
    dr = _dr()
    attr = dr.CUpointer_attribute
    ptr = dr.CUdeviceptr(pointer)
    kind = check(
        dr.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr),
        f"cuPointerGetAttribute({pointer:#x})",
    )
    if int(kind) != int(dr.CUmemorytype.CU_MEMORYTYPE_DEVICE):
        raise ValueError(f"KV memory at {pointer:#x} is not CUDA device memory")
    legacy = check(
        dr.cuPointerGetAttribute(
            attr.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr
        ),
        "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)",
    )
    if not int(legacy):
        raise ValueError(f"KV memory at {pointer:#x}: {_VMM_HINT}")
    return address_range(pointer)


def address_range(pointer: int) -> tuple[int, int]:
    """(base, size) of the allocation or IPC mapping holding `pointer`."""
    dr = _dr()
    got = dr.cuMemGetAddressRange(dr.CUdeviceptr(pointer))
    base, size = check(got, "cuMemGetAddressRange")
    return int(base), int(size)


def ipc_mem_handle(base: int) -> bytes:
    try:
        got = check(_rt().cudaIpcGetMemHandle(base), "cudaIpcGetMemHandle")
    except CudaError as exc:  # VMM memory that allocation_of did not catch
        raise ValueError(f"{exc}: {_VMM_HINT}") from exc
    return _to_bytes(got)


def create_ipc_event() -> tuple[Any, bytes]:
    """An interprocess event (no timing: required) and its handle bytes."""
    rt = _rt()
    flags = rt.cudaEventInterprocess | rt.cudaEventDisableTiming
    event = check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
    return event, _to_bytes(
        check(rt.cudaIpcGetEventHandle(event), "cudaIpcGetEventHandle")
    )


def record_event(event: Any, stream: int) -> None:
    rt = _rt()
    check(rt.cudaEventRecord(event, rt.cudaStream_t(stream)), "cudaEventRecord")


def create_timing_event() -> Any:
    """A plain event of this device that records timestamps (elapsed_s)."""
    rt = _rt()
    flags = rt.cudaEventDefault
    return check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")


def elapsed_s(begin: Any, end: Any) -> float:
    """Seconds of GPU time between two completed timing events."""
    return (
        float(check(_rt().cudaEventElapsedTime(begin, end), "cudaEventElapsedTime"))
        / 1e3
    )


def destroy_event(event: Any) -> None:
    check(_rt().cudaEventDestroy(event), "cudaEventDestroy")


# -- server side: import -------------------------------------------------------
def open_ipc_memory(handle: bytes) -> int:
    """Map another process's allocation; once per allocation per process."""
    rt = _rt()
    h = _from_bytes(rt.cudaIpcMemHandle_t, handle)
    flags = rt.cudaIpcMemLazyEnablePeerAccess
    return int(check(rt.cudaIpcOpenMemHandle(h, flags), "cudaIpcOpenMemHandle"))


def close_ipc_memory(pointer: int) -> None:
    check(_rt().cudaIpcCloseMemHandle(pointer), "cudaIpcCloseMemHandle")


def open_ipc_event(handle: bytes) -> Any:
    rt = _rt()
    h = _from_bytes(rt.cudaIpcEventHandle_t, handle)
    return check(rt.cudaIpcOpenEventHandle(h), "cudaIpcOpenEventHandle")


def event_done(event: Any) -> bool:
    """True once the event's latest record completed; raises on an error."""
    rt = _rt()
    err = rt.cudaEventQuery(event)[0]
    if err == rt.cudaError_t.cudaErrorNotReady:
        return False
    check((err,), "cudaEventQuery")
    return True


def mapped_word() -> tuple[int, int]:
    """(host address, device address) of 8 zeroed bytes of mapped pinned host
    memory, kept for the process's life: the word a stream writes when its work
    is done (stream_write32) and the host polls."""
    rt = _rt()
    flags = rt.cudaHostAllocMapped | rt.cudaHostAllocPortable
    host = int(check(rt.cudaHostAlloc(8, flags), "cudaHostAlloc"))
    ctypes.memset(host, 0, 8)
    dev = check(rt.cudaHostGetDevicePointer(host, 0), "cudaHostGetDevicePointer")
    return host, int(dev)


def stream_write32(stream: int, device_address: int, value: int) -> None:
    """Queue a 4-byte write of `value` on `stream`, after a memory fence and
    every copy queued before it (cuStreamWriteValue32)."""
    dr = _dr()
    ptr = dr.CUdeviceptr(device_address)
    flags = dr.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    check(dr.cuStreamWriteValue32(stream, ptr, value, flags), "cuStreamWriteValue32")


class HostRegistrar:
    """`pegaflow.cache.pool.PoolRegistrar` over cudaHostRegister(Mapped | Portable):
    the pool becomes DMA-able and reachable zero-copy from every context.

    The region is registered in chunks (at most 64 GiB each) from `threads`
    threads: pinning is page-table work the kernel can do in parallel. A
    restarted server pins chunk by chunk beside serving instead
    (`register_chunk`, pegaflow.cache.pin_chunks).
    """

    def __init__(
        self, ordinal: int, chunk_bytes: int = REGISTER_CHUNK, threads: int = 1
    ) -> None:
        if not 0 < chunk_bytes <= REGISTER_CHUNK or threads < 1:
            raise ValueError("chunk_bytes: need 1..64 GiB; threads: need >= 1")
        self._ordinal = ordinal
        self.chunk_bytes = chunk_bytes
        self.threads = threads
        self._chunks: dict[int, list[int]] = {}

    def register_chunk(self, address: int, size: int) -> None:
        """Pin one chunk. The copy engine reaches the pool through the device
        alias of its base plus an offset, so every chunk, registered on its
        own, must be reachable at its host address (UVA: H100, H200); one that
        is not is unregistered and refused, never copied to."""
        rt = _rt()
        set_device(self._ordinal)  # each thread: the runtime's device
        flags = rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable
        check(rt.cudaHostRegister(address, size, flags), "cudaHostRegister")
        try:
            got = rt.cudaHostGetDevicePointer(address, 0)
            alias = int(check(got, "cudaHostGetDevicePointer"))
            if alias != address:
                raise CudaError(
                    f"cudaHostGetDevicePointer: pool chunk {address:#x} is at "
                    f"{alias:#x} on device {self._ordinal}, not at its host address "
                    "(the GPU cannot use host pointers for registered memory)"
                )
        except CudaError:
            rt.cudaHostUnregister(address)
            raise

    def unregister_chunk(self, address: int) -> None:
        check(_rt().cudaHostUnregister(address), "cudaHostUnregister")

    def _register_one(self, address: int, size: int) -> int:
        self.register_chunk(address, size)
        return address

    def register(self, address: int, size: int) -> None:
        starts = list(range(address, address + size, self.chunk_bytes))
        sizes = [min(self.chunk_bytes, address + size - a) for a in starts]
        with ThreadPoolExecutor(self.threads) as pool:
            futures = list(
                map(pool.submit, [self._register_one] * len(starts), starts, sizes)
            )
        done = [f.result() for f in futures if f.exception() is None]
        if len(done) < len(futures):
            for chunk in done:
                _rt().cudaHostUnregister(chunk)
            raise next(f.exception() for f in futures if f.exception() is not None)
        self._chunks[address] = done
        logger.info("pool registered with CUDA: %d chunk(s)", len(done))

    def unregister(self, address: int) -> None:
        for chunk in self._chunks.pop(address, []):
            self.unregister_chunk(chunk)
