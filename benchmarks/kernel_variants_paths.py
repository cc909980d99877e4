"""Pieces of benchmarks/kernel_variants.py: the run's state, copy-engine and
small-batch paths (event, mapped flag, CUDA graph), ratios and the tables.

The graph path reuses kernels.cuda's private kernel and table (a benchmark may;
the server does not): it captures one launch of the block kernel reading a
descriptor table in mapped memory, so a replay copies whatever rows the table
holds, and a request of the same row count only rewrites those rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.common import table
from benchmarks.kernel_variants_mem import GpuMem, PoolKind, SimMem
from pegaflow.common.cuda_driver import check
from pegaflow.kernels import plan
from pegaflow.kernels.plan import LaunchShape

CAP = 66  # CTAs per direction in the server (pegaflow.copiers.cuda_copier.DEFAULT_CTAS)
SIM_CAP = 2
FLAG_TIMEOUT_S = 5.0
CEILING = "ceiling: 1 contiguous memcpy"

Call = Callable[[], None]


@dataclass
class Run:
    k: Any  # pegaflow.kernels.cuda (real or simulated)
    mem: Any  # GpuMem | SimMem
    s: Any  # two numba streams
    s2: Any
    sim: bool
    sms: int
    cap: int
    deadline: float  # time.monotonic(): cells after it are skipped
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    rows: list[dict] = field(default_factory=list)
    contiguous_slots: bool = False

    def reps(self, nbytes: int) -> int:
        if self.sim:
            return 2
        return 5 if nbytes > 1 << 30 else 10 if nbytes > 100 << 20 else 30

    def pick(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n random engine blocks and n random pool slots (a run of adjacent
        slots from a random start with contiguous_slots)."""
        shape = self.mem.shape
        ids = self.rng.choice(shape.blocks, n, replace=False)
        if self.contiguous_slots:
            start = int(self.rng.integers(0, shape.slots - n + 1))
            return ids, np.arange(start, start + n)
        return ids, self.rng.choice(shape.slots, n, replace=False)


def both_picks(r: Run, n: int) -> tuple[np.ndarray, ...]:
    """A save and a load of n blocks each at once: (saved blocks, blocks whose
    bytes fill the load's slots first, blocks loaded into, the save's slots,
    the load's slots); disjoint slots, adjacent with r.contiguous_slots."""
    m = r.mem
    perm = r.rng.permutation(m.shape.blocks)
    ia, ic = perm[:n], perm[n : 2 * n]
    ib = r.rng.choice(m.shape.blocks, n, replace=False)
    ps = np.arange(m.shape.slots)
    if not r.contiguous_slots:
        ps = r.rng.permutation(ps)
    return ia, ic, ib, ps[:n], ps[n : 2 * n]


def open_run(sim: bool, deadline: float, pool: PoolKind = "plain") -> Run:
    from pegaflow import kernels

    k = kernels.backend("cuda")
    if sim:
        assert k.SIMULATED, "NUMBA_ENABLE_CUDASIM was set too late"
        return Run(k, SimMem(k), k.stream(), k.stream(), True, 2, SIM_CAP, deadline)
    import torch

    mem = GpuMem(k, pool=pool)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return Run(k, mem, k.stream(), k.stream(), False, sms, CAP, deadline)


def versions(sim: bool) -> dict[str, object]:
    import numba_cuda

    out: dict[str, object] = {
        "simulated": sim,
        "numpy": np.__version__,
        "numba_cuda": getattr(numba_cuda, "__version__", "?"),
    }
    if not sim:
        import torch

        out.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    return out


class DmaPath:
    """cuMemcpyBatchAsync of a descriptor table (pegaflow.copiers.dma), the
    plan (checks + merging adjacent pages) inside the call as in the server."""

    def __init__(self, op: str, stream: Any) -> None:
        from pegaflow.copiers import dma

        self.dma = dma
        self.batch = dma.driver()
        self.attrs = dma.attributes("save" if op == "gather" else "load", 0)
        self.stream = int(stream.handle)

    def __call__(self, src: Any, dst: Any, t: Any) -> None:
        self.batch(self.dma.plan(src, dst, t), self.attrs, self.stream)


class Flag:
    """A word of mapped host memory the stream writes (cuStreamWriteValue32,
    after a memory fence) once the work before it is done; the host spins."""

    def __init__(self) -> None:
        from cuda.bindings import driver
        from numba import cuda

        self.d = driver
        self.mem = cuda.mapped_array(1, np.uint32)
        self.mem[0] = 0
        self.ptr = driver.CUdeviceptr(self.mem.device_ctypes_pointer.value)
        self.seq = 0

    def wait(self, stream: Any) -> None:
        self.seq = (self.seq + 1) & 0x7FFFFFFF
        d = self.d
        check(d.cuStreamWriteValue32(stream.handle, self.ptr, self.seq, 0), "write")
        give_up = time.perf_counter() + FLAG_TIMEOUT_S
        while int(self.mem[0]) != self.seq:
            if time.perf_counter() > give_up:
                raise TimeoutError("the mapped flag was never written")


def graph_call(k: Any, src: Any, dst: Any, t: Any, s: Any) -> Call:
    """Capture one block-kernel launch for `t`'s row count; each call plans
    the request as the real path does, rewrites the rows, replays, syncs."""
    from cuda.bindings import driver as d

    rows = k._default_blocks()

    def table_of() -> np.ndarray:
        return plan.split_table(plan.descriptor_table(src, dst, t), rows, k.MIN_PIECE)

    first = table_of()
    n = first.shape[1]
    tab = k._Table(n)
    tab.rows[:, :n] = first
    a, b = src.device_address, dst.device_address
    launch = k._kernel()[min(n, rows), k.THREADS, s]
    args = (a, b, a, b, tab.ptr, n, tab.cap, 16)
    launch(*args)
    k.synchronize(s)
    mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    check(d.cuStreamBeginCapture(s.handle, mode), "begin capture")
    try:
        launch(*args)
    finally:
        graph = check(d.cuStreamEndCapture(s.handle), "end capture")
    exe = check(d.cuGraphInstantiate(graph, 0), "instantiate")

    def call() -> None:
        tab.rows[:, :n] = table_of()
        check(d.cuGraphLaunch(exe, s.handle), "graph launch")
        k.synchronize(s)

    call.keep = (graph, exe, tab)  # type: ignore[attr-defined]
    return call


def latency_calls(
    k: Any, op: str, src: Any, dst: Any, t: Any, s: Any, mem: Any, sim: bool
) -> list[tuple[str, Callable[[], Call]]]:
    """(name, maker of a call that copies and waits until the host sees it)."""
    copy = k.gather if op == "gather" else k.scatter
    warp = {"shape": LaunchShape("warp")}
    nb = mem.slot_bytes

    def plain(kw: dict, wait: str = "sync") -> Callable[[], Call]:
        def make() -> Call:
            if wait == "flag":
                flag = Flag()
            if wait in ("event", "query"):
                from numba import cuda

                ev = cuda.event() if sim else cuda.event(timing=False)

            def call() -> None:
                copy(src, dst, t, stream=s, **kw)
                if wait == "sync":
                    k.synchronize(s)
                elif wait == "flag":
                    flag.wait(s)
                else:
                    ev.record(s)
                    if wait == "event":
                        ev.synchronize()
                    else:
                        while not ev.query():
                            pass

            return call

        return make

    def ceiling() -> Call:
        def call() -> None:
            mem.ceiling(op, nb, s)
            k.synchronize(s)

        return call

    out: list[tuple[str, Callable[[], Call]]] = [
        ("ceiling: 1 block memcpy + stream sync", ceiling),
        ("block + stream sync (current)", plain({})),
        ("block + event sync", plain({}, "event")),
        ("warp + stream sync", plain(warp)),
    ]
    if sim:
        return out
    dma = DmaPath(op, s)

    def dma_call(wait: str) -> Callable[[], Call]:
        def make() -> Call:
            flag = Flag()

            def call() -> None:
                dma(src, dst, t)
                if wait == "flag":
                    flag.wait(s)
                else:
                    k.synchronize(s)

            return call

        return make

    out += [
        ("block + event query spin", plain({}, "query")),
        ("block + mapped flag (cuStreamWriteValue32)", plain({}, "flag")),
        ("warp + mapped flag", plain(warp, "flag")),
        (
            "block CUDA graph replay + stream sync",
            lambda: graph_call(k, src, dst, t, s),
        ),
        ("copy engines + stream sync", dma_call("sync")),
        ("copy engines + mapped flag", dma_call("flag")),
    ]
    from benchmarks.kernel_variants_launch import launch_cells

    return out + launch_cells(k, src, dst, t, s)


# -- results -------------------------------------------------------------------
def add_ratios(rows: list[dict]) -> None:
    """ratio = GB/s over the ceiling row of the same op and N (this run)."""
    ceil = {(r["op"], r["N"]): r.get("gbps") for r in rows if r["variant"] == CEILING}
    for r in rows:
        c = ceil.get((r["op"], r["N"]))
        if "gbps" in r and c:
            r["ratio"] = r["gbps"] / c


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "ERROR"
    if "gbps" not in r:
        return "skipped"
    bad = "" if r["ok"] else " BAD"
    ratio = f" ({r['ratio']:.2f})" if "ratio" in r else ""
    return f"{r['gbps']:.1f}{ratio}{bad}"


def tables(rows: list[dict], sizes: tuple[int, ...]) -> str:
    out = []
    for op, what in (("gather", "save, GPU -> pinned host"), ("scatter", "load")):
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            continue
        out.append(f"\n{op} ({what}): GB/s (ratio to the ceiling of the same N)")
        lines = []
        for name in dict.fromkeys(r["variant"] for r in mine):
            line: dict[str, object] = {"variant": name}
            for n in sizes:
                hit = [r for r in mine if r["variant"] == name and r["N"] == n]
                line[f"N={n}"] = _cell(hit[0] if hit else None)
            lines.append(line)
        out.append(table(lines, ["variant", *(f"N={n}" for n in sizes)]))
    both = [r for r in rows if r["op"] == "both"]
    if both:
        n = both[0]["N"]
        out.append(f"\nsave + load at once, N={n} each: total GB/s (ratio to 2 copies)")
        lines = [{"variant": r["variant"], "total": _cell(r)} for r in both]
        out.append(table(lines, ["variant", "total"]))
    lat = [r for r in rows if r["op"].startswith("lat_")]
    if lat:
        out.append("\nN=1 (1 block x all layers): call until the host sees it, us")
        lines = []
        for name in dict.fromkeys(r["variant"] for r in lat):
            line = {"variant": name}
            for op, tag in (("lat_gather", "save"), ("lat_scatter", "load")):
                hit = [r for r in lat if r["variant"] == name and r["op"] == op]
                r = hit[0] if hit else None
                for q in ("p50", "p90"):
                    v = None if r is None else r.get(f"{q}_us")
                    bad = "" if r is None or r.get("ok") else " BAD"
                    line[f"{tag} {q.upper()}"] = "-" if v is None else f"{v:.0f}{bad}"
            lines.append(line)
        cols = ["variant", "save P50", "save P90", "load P50", "load P90"]
        out.append(table(lines, cols))
    errors = [r for r in rows if "error" in r]
    if errors:
        out.append("\nerrors:")
        out += [f"  {r['op']} N={r['N']} {r['variant']}: {r['error']}" for r in errors]
    return "\n".join(out)
