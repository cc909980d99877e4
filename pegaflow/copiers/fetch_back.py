"""Device ranges back into host memory, for checking what a direct SSD → GPU
read landed (gds.gpu_reads.FetchBack): one gather launch of the copy kernels
into mapped pinned memory (~50 GB/s on the H200, benchmarks/RESULTS.md), where
the disk gave ~1.5 GB/s, so a check costs a few percent of the load.

The host buffer grows on demand and is reused; one DeviceFetch per thread
(the buffer is handed out as a view until the next call).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from pegaflow import kernels
from pegaflow.common.geometry import Transfers

DEFAULT_CTAS = 66  # as copiers.cuda: half the H200's SMs, the engine keeps the rest


class DeviceFetch:
    def __init__(self, capacity: int = 64 << 20, max_ctas: int = DEFAULT_CTAS) -> None:
        self._k = kernels.backend("cuda")
        self._ctas = max_ctas
        self._stream = self._k.stream()
        self._buf: Any = None
        self._view = memoryview(b"")
        self._grow(capacity)

    def _grow(self, nbytes: int) -> None:
        size = max(nbytes, 4096)
        self._buf = self._k.mapped_buffer(size)  # pinned, device-mapped
        address = self._buf.address
        self._view = memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")

    def __call__(self, src: np.ndarray, nbytes: np.ndarray, total: int) -> memoryview:
        """Ranges (src[i], nbytes[i]) of device memory back to back into the
        host buffer; a view of its first `total` bytes once they landed."""
        if total > self._buf.nbytes:
            self._grow(total)
        if not len(src):
            return self._view[:total]
        src = np.asarray(src, np.uint64)
        n = np.asarray(nbytes, np.uint64)
        lo, hi = int(src.min()), int((src + n).max())
        dst = np.uint64(self._buf.address) + (np.cumsum(n, dtype=np.uint64) - n)
        device = self._k.wrap(lo, hi - lo)
        t = Transfers(src, dst, n)
        self._k.gather(device, self._buf, t, stream=self._stream, max_blocks=self._ctas)
        self._k.synchronize(self._stream)
        return self._view[:total]
