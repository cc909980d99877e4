"""The GPU half of pegaflow.kernels.cuda under numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1): the same calls as pegaflow.kernels.device_driver,
over numba's simulated streams, events and mapped arrays, and the copy
kernel's source (pegaflow.kernels.copy_kernel) run by numba on numpy-backed
arrays. Simulated device memory is host memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import copy_kernel
from .copy_kernel import cuda
from .cpu import wrap as host_wrap
from .plan import Buffer, aligned_empty


def wrap(address: int, nbytes: int, mapped: bool, owner: Any) -> Buffer:
    b = host_wrap(address, nbytes, owner=owner)
    fake = cuda.cudadrv.devicearray.FakeCUDAArray  # wraps, never copies
    words = b.data[: nbytes // 8 * 8].view(np.uint64)
    return Buffer(address, address, nbytes, fake(b.data), fake(words), b.owner)


def staging_buffer(nbytes: int) -> Buffer:
    host = aligned_empty(nbytes)
    return wrap(host.ctypes.data, nbytes, False, host)


def mapped_buffer(nbytes: int) -> Buffer:
    host = aligned_empty(nbytes)
    return wrap(host.ctypes.data, nbytes, True, host)


def stream() -> Any:
    return cuda.stream()


def synchronize(stream: Any) -> None:
    """The simulator runs each launch to its end: nothing to wait for."""


class Table:
    __slots__ = ("arg", "cap", "done", "rows")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.arg = cuda.mapped_array(3 * self.cap, np.int64)
        self.rows = np.asarray(self.arg).reshape(3, self.cap)
        self.done = cuda.event()


def launch(
    blocks: int, threads: int, stream: Any, src: Buffer, dst: Buffer,
    tab: Table, n: int, width: int,
) -> None:  # fmt: skip
    kernel = copy_kernel.simulated()
    kernel[blocks, threads, stream](
        src.data, dst.data, src.words, dst.words, tab.arg, n, tab.cap, width
    )
