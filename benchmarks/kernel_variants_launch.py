"""N = 1 latency cells of benchmarks/kernel_variants.py that split the block
kernel's call into its parts, to say where a 1-block copy's ~160-210 us go
when one memcpy of the same bytes plus a sync takes ~47 us (2026-12-02):

- planned once: the descriptor table built and split once, outside the
  timed call; the call fills the rows, launches through numba, syncs
- planned once, cuLaunchKernel: the same, launched through the driver entry
  point with a parameter buffer packed once (no numba or cuda.core dispatch)
- graph replay, planned once: the captured launch replayed and synced
- GPU time: timing events around the numba launch (what the kernel itself
  takes on the device, launch gaps excluded), reported as its own cell

Like kernel_variants_paths.graph_call these reuse kernels.cuda's private
kernel and table (a benchmark may; the server does not).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.cuda_driver import check
from pegaflow.kernels import plan

Call = Callable[[], None]


class _Planned:
    """The table of `t` built once; rows written into a table of the kernel's
    own kind before each launch (as the real path writes them)."""

    def __init__(self, k: Any, src: Any, dst: Any, t: Any) -> None:
        rows = k._default_blocks()
        self.table = plan.split_table(
            plan.descriptor_table(src, dst, t), rows, k.MIN_PIECE
        )
        self.n = self.table.shape[1]
        self.tab = k._Table(self.n)
        self.blocks = min(self.n, rows)
        a, b = src.device_address, dst.device_address
        self.args = (a, b, a, b, self.tab.ptr, self.n, self.tab.cap, 16)
        self.k = k

    def fill(self) -> None:
        self.tab.rows[:, : self.n] = self.table


def numba_planned(k: Any, src: Any, dst: Any, t: Any, s: Any) -> Call:
    p = _Planned(k, src, dst, t)
    launch = k._kernel()[p.blocks, k.THREADS, s]

    def call() -> None:
        p.fill()
        launch(*p.args)
        k.synchronize(s)

    return call


def _cu_function(kernel: Any) -> Any:
    """The driver function of the (signature-compiled) numba kernel."""
    from cuda.bindings import driver as d

    compiled = next(iter(kernel.overloads.values()))
    handle = compiled._codelibrary.get_cufunc().handle
    if isinstance(handle, d.CUfunction):
        return handle
    return check(d.cuKernelGetFunction(handle), "kernel function")  # a CUkernel


def driver_planned(k: Any, src: Any, dst: Any, t: Any, s: Any) -> Call:
    from cuda.bindings import driver as d

    p = _Planned(k, src, dst, t)
    kernel = k._kernel()
    kernel[p.blocks, k.THREADS, s](*p.args)  # compiled and loaded
    k.synchronize(s)
    func = _cu_function(kernel)
    # Every parameter is 8 bytes (three pointers as uint8*/uint64*, the table
    # pointer, three int64): one array of values, one of pointers to them.
    values = (ctypes.c_uint64 * len(p.args))(*[v & (2**64 - 1) for v in p.args])
    ptrs = (ctypes.c_void_p * len(p.args))(
        *[ctypes.addressof(values) + 8 * i for i in range(len(p.args))]
    )
    stream = d.CUstream(int(s.handle))
    threads = k.THREADS

    def call() -> None:
        p.fill()
        err = d.cuLaunchKernel(
            func, p.blocks, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(ptrs), 0
        )
        check(err, "launch")
        k.synchronize(s)

    call.keep = (values, ptrs)  # type: ignore[attr-defined]
    return call


def graph_planned(k: Any, src: Any, dst: Any, t: Any, s: Any) -> Call:
    from cuda.bindings import driver as d

    p = _Planned(k, src, dst, t)
    launch = k._kernel()[p.blocks, k.THREADS, s]
    p.fill()
    launch(*p.args)
    k.synchronize(s)
    mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    check(d.cuStreamBeginCapture(s.handle, mode), "begin capture")
    try:
        launch(*p.args)
    finally:
        graph = check(d.cuStreamEndCapture(s.handle), "end capture")
    exe = check(d.cuGraphInstantiate(graph, 0), "instantiate")

    def call() -> None:
        p.fill()
        check(d.cuGraphLaunch(exe, s.handle), "graph launch")
        k.synchronize(s)

    call.keep = (graph, exe, p)  # type: ignore[attr-defined]
    return call


def launch_cells(
    k: Any, src: Any, dst: Any, t: Any, s: Any
) -> list[tuple[str, Callable[[], Call]]]:
    return [
        ("block planned once + stream sync", lambda: numba_planned(k, src, dst, t, s)),
        (
            "block planned once, cuLaunchKernel",
            lambda: driver_planned(k, src, dst, t, s),
        ),
        ("block graph replay, planned once", lambda: graph_planned(k, src, dst, t, s)),
    ]


def gpu_time_us(
    k: Any, src: Any, dst: Any, t: Any, s: Any, reps: int
) -> dict[str, float]:
    """Device time of the numba launch of a planned table (timing events
    around it), and the host time of the launch call alone; P50s in us."""
    from numba import cuda

    p = _Planned(k, src, dst, t)
    launch = k._kernel()[p.blocks, k.THREADS, s]
    start, end = cuda.event(timing=True), cuda.event(timing=True)
    gpu, host = [], []
    for _ in range(reps):
        p.fill()
        start.record(s)
        t0 = time.perf_counter()
        launch(*p.args)
        host.append(time.perf_counter() - t0)
        end.record(s)
        end.synchronize()
        gpu.append(cuda.event_elapsed_time(start, end) / 1e3)
    return {
        "gpu_p50_us": float(np.median(gpu) * 1e6),
        "launch_call_p50_us": float(np.median(host) * 1e6),
        "rows": p.n,
        "blocks": p.blocks,
    }
