"""Staged rounds against the zero-copy kernel and page DMA (issue 12).

The zero-copy block kernel tops out at 0.89-0.92 of the pinned ceiling on
scattered 64 KiB pages, copy engines over the same pages at 0.46-0.86, and two
kernels at once (a save and a load) at ~70 GB/s where two contiguous copies
reach 89-101 (RESULTS.md). Staged rounds split the work by what each unit is
good at: a kernel packs a round's pages into device staging memory (HBM to
HBM, a few per cent of the PCIe time), then one cuMemcpyBatchAsync moves the
round's whole slots (2 MiB each) over PCIe on a second stream while the next
round packs (pegaflow.kernels.base.gather_staged; loads the other way round).
PCIe then only ever sees the copy engines, one per direction, so a save and a
load can overlap as two plain copies do, and the SMs are busy for only the
pack: less time-slicing with the engine's compute (another CUDA context).

Rows: ceiling (one contiguous memcpy), the server's kernel (66 CTAs), copy
engines over pages, staged rounds of several sizes and part counts; then a
save and a load at once (N = 640 each); then, with a bf16 matmul loop in a
second process (the engine), each path's GB/s and the matmul's slowdown.
Every timed cell byte-checked (poisoned destination, first and last rep).

    PYTHONPATH=$PWD python3 benchmarks/staged_rounds.py --json $OUT/staged.json
    python3 benchmarks/staged_rounds.py --simulate     # harness check, tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from benchmarks import kernel_variants_paths as paths  # noqa: E402
from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.kernel_variants import measure, measure_both_ceiling  # noqa: E402
from benchmarks.kernel_variants_paths import CEILING, Run  # noqa: E402

SIZES, SIM_SIZES = (64, 640, 2560), (5,)
BOTH_N, SIM_BOTH_N = 640, 3
STAGING = 128 << 20  # bytes per direction (the server's default)
SIM_STAGING = 2048
MIB = 1 << 20
# (name, parts, round bytes, CTA cap, DMA): rounds of a part's size when
# round bytes is None; DMA "batch" is one cuMemcpyBatchAsync a round,
# "memcpy" one cuMemcpyAsync a run (call 1 of 2026-12-03: batches of the two
# directions did not overlap)
ROUNDS = (
    ("staged 2 x 64 MiB batch", 2, None, None, "batch"),
    ("staged 2 x 64 MiB memcpy", 2, None, None, "memcpy"),
    ("staged 4 x 32 MiB memcpy", 4, None, None, "memcpy"),
)
SIM_ROUNDS = (
    ("staged 2 parts", 2, None, None, "memcpy"),
    ("staged 4 x 256 B", 4, 256, 2, "memcpy"),
)
WINDOW_S = 2.0


def run_copies(op: str, lane: Any) -> Callable:
    """A staged round's copy (pegaflow.kernels.base.Dma) on `lane`: its runs,
    staging <-> pool offsets, as one cuMemcpyBatchAsync (paths.DmaPath; a
    round's runs are whole 2 MiB slots)."""
    from pegaflow.common.geometry import Transfers

    batch = paths.DmaPath(op, lane)

    def copy(src: Any, dst: Any, runs: np.ndarray, stream: Any) -> None:
        assert stream is lane, "a staged round's runs move on its copy stream"
        rows = runs.astype(np.uint64)
        at = np.array([[src.address], [dst.address], [0]], np.uint64)
        batch(src, dst, Transfers(*(rows + at)))

    return copy


class Staged:
    """One direction's staged call: its staging, second stream and batch DMA
    (a per-run copy under the simulator, which has no copy engines)."""

    def __init__(self, r: Run, op: str, nbytes: int) -> None:
        self.r, self.op = r, op
        self.staging = r.k.staging_buffer(nbytes)
        self.lane = r.k.stream()
        self.dma = None
        if not r.sim:
            self.dma = run_copies(op, self.lane)

    def call(self, src: Any, dst: Any, t: Any, stream: Any, spec: tuple) -> Callable:
        _, parts, round_bytes, cap, how = spec
        k = self.r.k
        fn = k.gather_staged if self.op == "gather" else k.scatter_staged
        dma = self.dma if how == "batch" else None
        kw = dict(parts=parts, round_bytes=round_bytes, max_blocks=cap, dma=dma)

        def run() -> None:
            fn(src, dst, t, self.staging, stream=stream, copy_stream=self.lane, **kw)

        return run


def rounds(r: Run) -> tuple[tuple, ...]:
    return SIM_ROUNDS if r.sim else ROUNDS


def direction(r: Run, op: str, sizes: tuple[int, ...], staged: Staged) -> None:
    k, m = r.k, r.mem
    gather = op == "gather"
    if not gather:
        m.randomize_pool()
    src, dst = (m.eng, m.pool) if gather else (m.pool, m.eng_back)
    copy = k.gather if gather else k.scatter
    check = m.check_gather if gather else m.check_scatter
    make_t = m.save_t if gather else m.load_t
    poison = m.poison_pool if gather else m.poison_back
    for n in sizes:
        ids, slots = r.pick(n)
        t = make_t(ids, slots)
        nb = n * m.slot_bytes

        def ok(ids: np.ndarray = ids, slots: np.ndarray = slots) -> bool:
            return check(ids, slots)

        def ceiling(nb: int = nb) -> None:
            m.ceiling(op, nb, r.s)

        def flat_ok(nb: int = nb) -> bool:
            return m.check_flat(op, nb)

        def kernel(t: Any = t, cap: int | None = r.cap) -> None:
            copy(src, dst, t, stream=r.s, max_blocks=cap)

        def one_stream(t: Any = t) -> None:
            one = k.gather_staged if gather else k.scatter_staged
            one(src, dst, t, staged.staging, stream=r.s)

        cells: list[tuple[str, Callable, Callable]] = [
            (CEILING, ceiling, flat_ok),
            (f"kernel cap {r.cap}", kernel, ok),
            ("kernel full grid", lambda: kernel(cap=None), ok),
            ("staged 1 stream, per-run memcpy", one_stream, ok),
        ]
        if not r.sim:
            dma = paths.DmaPath(op, r.s)
            cells.append(("copy engines, pages", lambda t=t, d=dma: d(src, dst, t), ok))
        for spec in rounds(r):
            cells.append((spec[0], staged.call(src, dst, t, r.s, spec), ok))
        for name, run, good in cells:
            measure(r, op, n, name, nb, run, good, poison, (r.s, staged.lane))


def both_cells(r: Run, save: Staged, load: Staged) -> tuple[list, Callable, Callable]:
    """A save and a load of N blocks at once, by each pairing of paths."""
    k, m = r.k, r.mem
    n = SIM_BOTH_N if r.sim else BOTH_N
    ia, ic, ib, sa, sb = paths.both_picks(r, n)
    ta, tb = m.save_t(ia, sa), m.load_t(ib, sb)
    fill = m.save_t(ic, sb)

    def prepare() -> None:
        m.poison_pool()
        k.gather(m.eng, m.pool, fill, stream=r.s)
        k.synchronize(r.s)
        m.poison_back()

    cap = {"max_blocks": r.cap}

    def pair(a: Callable, b: Callable) -> Callable:
        return lambda: (a(), b())

    def kernel_save() -> None:
        k.gather(m.eng, m.pool, ta, stream=r.s, **cap)

    def kernel_load() -> None:
        k.scatter(m.pool, m.eng_back, tb, stream=r.s2, **cap)

    cells = [(f"kernels cap {r.cap} each", pair(kernel_save, kernel_load))]
    for spec in rounds(r)[:2]:
        staged_save = save.call(m.eng, m.pool, ta, r.s, spec)
        staged_load = load.call(m.pool, m.eng_back, tb, r.s2, spec)
        cells += [
            (f"{spec[0]} both", pair(staged_save, staged_load)),
            (f"{spec[0]} save + kernel load", pair(staged_save, kernel_load)),
            (f"kernel save + {spec[0]} load", pair(kernel_save, staged_load)),
        ]
    ok = lambda: m.check_both((ia, sa), (ib, sb))  # noqa: E731
    return cells, ok, prepare


def run_both(r: Run, save: Staged, load: Staged) -> None:
    n = SIM_BOTH_N if r.sim else BOTH_N
    cells, ok, prepare = both_cells(r, save, load)
    measure_both_ceiling(r, n)
    streams = (r.s, r.s2, save.lane, load.lane)
    for name, run in cells:
        measure(r, "both", n, name, 2 * n * r.mem.slot_bytes, run, ok, prepare, streams)


def run_interference(r: Run, save: Staged, load: Staged) -> list[dict]:
    """Each path streams N = 640 saves, loads or both for a window while a
    matmul loop runs in another process; the matmul's rate against alone."""
    from benchmarks.interference import Matmul

    m, k = r.mem, r.k
    n = BOTH_N
    cells, ok, prepare = both_cells(r, save, load)
    by_name = dict(cells)
    ids, slots = r.pick(n)
    ts, tl = m.save_t(ids, slots), m.load_t(ids, slots)
    ds, dl = paths.DmaPath("gather", r.s), paths.DmaPath("scatter", r.s)

    def kernel_save() -> None:
        k.gather(m.eng, m.pool, ts, stream=r.s, max_blocks=r.cap)

    def kernel_load() -> None:
        k.scatter(m.pool, m.eng_back, tl, stream=r.s, max_blocks=r.cap)

    paths_: dict[str, dict[str, Callable]] = {
        f"kernel cap {r.cap}": {
            "save": kernel_save,
            "load": kernel_load,
            "both": by_name[f"kernels cap {r.cap} each"],
        },
        "copy engines, pages": {
            "save": lambda: ds(m.eng, m.pool, ts),
            "load": lambda: dl(m.pool, m.eng_back, tl),
        },
    }
    for spec in rounds(r)[:2]:
        paths_[spec[0]] = {
            "save": save.call(m.eng, m.pool, ts, r.s, spec),
            "load": load.call(m.pool, m.eng_back, tl, r.s, spec),
            "both": by_name[f"{spec[0]} both"],
        }
    final = by_name[f"{rounds(r)[1][0]} both"]
    streams = (r.s, r.s2, save.lane, load.lane)
    out = []
    mm = Matmul(8192)
    try:
        alone = mm.rate(WINDOW_S)
        for name, modes in paths_.items():
            for mode, fn in modes.items():
                if time.monotonic() > r.deadline:
                    break
                nbytes = (2 if mode == "both" else 1) * n * m.slot_bytes
                alone_gbps = window(r, fn, streams, None)
                busy = window(r, fn, streams, mm)
                row = {
                    "path": name,
                    "mode": mode,
                    "copy_alone_GBps": alone_gbps * nbytes / 1e9,
                    "copy_GBps": busy[0] * nbytes / 1e9,
                    "slowdown_pct": 100 * (1 - busy[1] / alone),
                }
                out.append(row)
                print(row, flush=True)
        prepare()
        final()
        for s in streams:
            k.synchronize(s)
        out.append({"path": "check after windows", "ok": bool(ok())})
    finally:
        mm.close()
    return out


def window(r: Run, fn: Callable, streams: tuple, mm: Any) -> Any:
    """Copies per second over a window (and the matmul's rate, with `mm`)."""
    done = threading.Event()
    count = [0, 0.0]

    def loop() -> None:
        from numba import cuda

        cuda.current_context()  # the driver's batch call needs one current
        start = time.perf_counter()
        while not done.is_set():
            fn()
            for s in streams:
                r.k.synchronize(s)
            count[0] += 1
        count[1] = time.perf_counter() - start

    th = threading.Thread(target=loop)
    th.start()
    if mm is None:
        time.sleep(WINDOW_S)
        rate = None
    else:
        rate = mm.rate(WINDOW_S)
    done.set()
    th.join()
    per_s = count[0] / count[1]
    return per_s if mm is None else (per_s, rate)


def huge_meminfo(r: Run) -> dict[str, object]:
    """/proc/meminfo's hugepage lines while the pool is mapped, and the pool's
    own share of 2 MiB pages (did THP take?)."""
    from pegaflow.cache.hugepages import huge_share

    with open("/proc/meminfo") as f:
        rows = [line.split(":") for line in f if "Huge" in line]
    out: dict[str, object] = {k: v.strip() for k, v in rows}
    if not r.sim:
        out["pool_huge_share"] = huge_share(r.mem.pool.address, r.mem.pool.nbytes)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--only", default="gather,scatter,both,interference")
    ap.add_argument("--pool", default="plain", choices=("plain", "thp", "hugetlb"))
    ap.add_argument("--sizes", default=None, help="comma list of N")
    ap.add_argument(
        "--slots",
        default="random",
        choices=("random", "contiguous"),
        help="pool slots of a batch: random, or adjacent (engine blocks random)",
    )
    args = ap.parse_args(argv)
    if args.simulate:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    only = set(args.only.split(","))
    t0 = time.monotonic()
    r = paths.open_run(args.simulate, t0 + args.budget_s, args.pool)
    r.contiguous_slots = args.slots == "contiguous"
    sizes = SIM_SIZES if r.sim else SIZES
    if args.sizes:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    cap = SIM_STAGING if r.sim else STAGING
    save, load = Staged(r, "gather", cap), Staged(r, "scatter", cap)
    for op, side in (("gather", save), ("scatter", load)):
        if op in only:
            direction(r, op, sizes, side)
    if "both" in only:
        run_both(r, save, load)
    inter: list[dict] = []
    if "interference" in only and not r.sim:
        inter = run_interference(r, save, load)
    paths.add_ratios(r.rows)
    meta = {
        **paths.versions(r.sim),
        "pool": args.pool,
        "slots": args.slots,
        "meminfo": huge_meminfo(r),
    }
    meta["seconds"] = time.monotonic() - t0
    if args.json:
        out = {"meta": meta, "rows": r.rows, "interference": inter}
        write_json("staged_rounds", out, str(args.json))
    print(paths.tables(r.rows, sizes))
    if inter:
        cols = ["path", "mode", "copy_alone_GBps", "copy_GBps", "slowdown_pct"]
        print(table([x for x in inter if "mode" in x], cols))
    bad = [x for x in r.rows if x.get("ok") is False]
    bad += [x for x in inter if x.get("ok") is False]
    print(f"pool: {args.pool}, {meta['meminfo'].get('pool_huge_share')} on 2 MiB pages")
    print("bytes ok" if not bad else f"FAILED: {len(bad)} cells")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
