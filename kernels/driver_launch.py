"""Launches of the signature-compiled copy kernels through the driver's
cuLaunchKernel, their parameters packed into one reused buffer.

numba's dispatch of a launch (argument typing, then cuda.core packing each
argument) took ~20-30 us of a 1-block copy on the H200 (benchmarks/RESULTS.md,
2026-12-02, fourth session, "Where a 1-block kernel copy's time goes": 71-85 us
for a planned table launched by numba, 54-56 us through cuLaunchKernel, 51-54
us replaying a CUDA graph). Every parameter of these kernels is 8 bytes (pointers
passed as integers, int64 counts), so one uint64 array holds them all and a
second holds a pointer to each.

The first launch on each stream goes through numba, which compiles the kernel
and loads its module in the stream's context (the current one); the driver
function is looked up after it. What is known is kept per stream object, as
long as that object lives: a stream destroyed and another created with the
same handle value (in another context, perhaps) starts over. Where the
function cannot be found (another numba-cuda), numba keeps launching; nothing
else changes. Callers serialise launches (the table lock), so the one parameter
buffer is never filled by two threads at once; the driver copies the
parameters at the call, so the next fill cannot reach a queued launch.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np

from pegaflow.common.cuda_driver import check

logger = logging.getLogger(__name__)


class DriverLaunch:
    def __init__(self, kernel: Any, nargs: int) -> None:
        self._kernel = kernel  # a numba dispatcher compiled for one signature
        self._values = np.zeros(nargs, np.uint64)
        base = self._values.ctypes.data
        self._pointers = np.arange(nargs, dtype=np.uint64) * np.uint64(8) + np.uint64(
            base
        )
        self._params = int(self._pointers.ctypes.data)
        # numba stream -> (its CUstream, the kernel's CUfunction in the
        # stream's context, or None: numba launches). A stream belongs to one
        # context, so no current-context query per launch.
        self._streams: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(
        self, blocks: int, threads: int, stream: Any, args: tuple[int, ...]
    ) -> None:
        from cuda.bindings import driver as d

        known = self._streams.get(stream)
        if known is None:  # this stream's first launch: numba loads the module
            self._kernel[blocks, threads, stream](*args)
            cu_stream = d.CUstream(int(stream.handle))
            self._streams[stream] = (cu_stream, _function(self._kernel))
            return
        cu_stream, func = known
        if func is None:
            self._kernel[blocks, threads, stream](*args)
            return
        self._values[:] = args
        err = d.cuLaunchKernel(
            func, blocks, 1, 1, threads, 1, 1, 0, cu_stream, self._params, 0
        )
        check(err, "kernel launch")


def _function(kernel: Any) -> Any:
    """The current context's CUfunction of a signature-compiled numba kernel,
    or None where this numba-cuda does not expose it."""
    from cuda.bindings import driver as d

    try:
        (compiled,) = kernel.overloads.values()
        handle = compiled._codelibrary.get_cufunc().handle
        if isinstance(handle, d.CUfunction):
            return handle
        return check(d.cuKernelGetFunction(handle), "kernel function")  # a CUkernel
    except Exception as exc:  # a numba-cuda of another shape: numba launches
        logger.info("kernel launches stay with numba: %s", exc)
        return None
