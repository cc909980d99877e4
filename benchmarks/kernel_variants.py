"""Copy strategies for issue 12, side by side on one GPU: kernel variants, copy
engines and the pinned ceiling, per direction and batch size.

Llama-3.1-8B shape (32 layers x 64 KiB pages, vLLM 0.33 layout), N random
engine blocks <-> N random pool slots (registered mapped, as pegaflow's pool).
For each direction (gather = save, GPU -> pinned host; scatter = load) and N:

- ceiling: one contiguous cuMemcpyAsync of the same bytes, this run
- block ...: the first kernel (a CUDA block per descriptor), several CTA shapes
- warp ...: the warp kernel (a warp per descriptor piece), several cuts
- copy engines: cuMemcpyBatchAsync from numpy arrays (pegaflow.copiers.dma),
  adjacent pages merged; once with random ids, once with contiguous ids+slots

then save + load at once (N = 640 each; two streams, or one launch of the warp
kernel over both tables), and N = 1 latency of the whole small-batch path
(planning + launch + completion seen by the host: stream sync, event sync, event
query spin, a flag written to mapped host memory by cuStreamWriteValue32, CUDA
graph replay). Every timed cell runs once on a poisoned destination and is
checked byte for byte (copied and untouched bytes), timed, then its last
repetition runs on a fresh poison and is checked again. Times are wall clock per
call + sync, Python planning included. A short table comes last; JSON to --json.

    PYTHONPATH=$PWD python3 benchmarks/kernel_variants.py --json $OUT/kv.json
    python3 benchmarks/kernel_variants.py --simulate   # CPU: numba's simulator
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from benchmarks import kernel_variants_paths as paths  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from benchmarks.kernel_variants_paths import CEILING, Run  # noqa: E402
from pegaflow.kernels.plan import LaunchShape  # noqa: E402

SIZES = (1, 8, 64, 640, 2560)
SIM_SIZES = (1, 2, 4)
BOTH_N, SIM_BOTH_N = 640, 3
LAT_REPS, SIM_LAT_REPS = 200, 3


def kernel_variants(r: Run) -> list[tuple[str, dict]]:
    """(name, keyword arguments of gather / scatter) for every kernel variant."""
    w = LaunchShape("warp")
    threads = (64,) if r.sim else (128, 512, 1024)
    out: list[tuple[str, dict]] = [
        ("block 256 (current)", {}),
        (f"block 256 cap {r.cap}", {"max_blocks": r.cap}),
        ("block 256 8B words", {"width": 8}),
    ]
    out += [(f"block {t}", {"shape": LaunchShape(threads=t)}) for t in threads]
    out += [
        ("warp 256", {"shape": w}),
        (f"warp 256 cap {r.cap}", {"shape": w, "max_blocks": r.cap}),
        (f"warp 256 grid=SMs ({r.sms})", {"shape": w, "max_blocks": r.sms}),
        ("warp 256 parts 4", {"shape": LaunchShape("warp", parts=4)}),
        ("warp 256 parts 16", {"shape": LaunchShape("warp", parts=16)}),
    ]
    out += [(f"warp {t}", {"shape": LaunchShape("warp", threads=t)}) for t in threads]
    if r.sim:  # the simulator's default is 32 threads: name it honestly
        out = [(n.replace(" 256", " sim-default"), kw) for n, kw in out]
    return out


def measure(
    r: Run,
    op: str,
    n: int,
    name: str,
    nbytes: int,
    run: Callable[[], None],
    ok: Callable[[], bool],
    prepare: Callable[[], None],
    streams: tuple[Any, ...],
) -> dict:
    row: dict[str, Any] = {"op": op, "variant": name, "N": n, "bytes": nbytes}
    r.rows.append(row)
    if time.monotonic() > r.deadline:
        row.update(ok=None, skipped="time budget")
        return row

    def sync() -> None:
        for s in streams:
            r.k.synchronize(s)

    try:
        prepare()
        run()
        sync()
        first = ok()
        reps = r.reps(nbytes)
        times = []
        for i in range(reps):
            if i == reps - 1:
                prepare()  # the last timed repetition lands on fresh poison
            t0 = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - t0)
        row["ok"] = bool(first and ok())
        med = statistics.median(times)
        row.update(reps=reps, median_s=med, gbps=nbytes / med / 1e9)
    except Exception as e:  # one failing variant must not end the run
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        sync_quietly(r)
    print(line(row), flush=True)
    return row


def sync_quietly(r: Run) -> None:
    for s in (r.s, r.s2):
        try:
            r.k.synchronize(s)
        except Exception as e:  # the error is in the row already
            print(f"  sync after error: {e}")


def line(row: dict) -> str:
    head = f"{row['op']:8} N={row['N']:<5} {row['variant']:40}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    if "gbps" in row:
        return f"{head} {row['gbps']:7.2f} GB/s ok={row['ok']}"
    if "p50_us" in row:
        p50, p90 = row["p50_us"], row["p90_us"]
        return f"{head} P50 {p50:7.1f} us P90 {p90:7.1f} ok={row['ok']}"
    return f"{head} skipped"


Cell = tuple[str, Callable[[], None], Callable[[], bool]]  # name, run, check


def run_direction(r: Run, op: str, sizes: tuple[int, ...]) -> None:
    if op == "scatter":
        r.mem.randomize_pool()  # the load's source, fixed for the whole sweep
    poison = r.mem.poison_pool if op == "gather" else r.mem.poison_back
    for n in sizes:
        nb = n * r.mem.slot_bytes
        for name, run, ok in direction_cells(r, op, n):
            measure(r, op, n, name, nb, run, ok, poison, (r.s,))


def direction_cells(r: Run, op: str, n: int) -> list[Cell]:
    """Every strategy for N blocks one way, each with its byte check."""
    k, m = r.k, r.mem
    gather = op == "gather"
    src, dst = (m.eng, m.pool) if gather else (m.pool, m.eng_back)
    copy = k.gather if gather else k.scatter
    check = m.check_gather if gather else m.check_scatter
    make_t = m.save_t if gather else m.load_t
    ids, slots = r.pick(n)
    cids = cslots = np.arange(n)
    t, ct = make_t(ids, slots), make_t(cids, cslots)
    nb = n * m.slot_bytes

    def ok() -> bool:
        return check(ids, slots)

    cells: list[Cell] = [
        (CEILING, lambda: m.ceiling(op, nb, r.s), lambda: m.check_flat(op, nb))
    ]
    for name, kw in kernel_variants(r):
        run = lambda kw=kw: copy(src, dst, t, stream=r.s, **kw)  # noqa: E731
        cells.append((name, run, ok))
    if not r.sim:
        dma = paths.DmaPath(op, r.s)
        cells.append(("copy engines", lambda: dma(src, dst, t), ok))
        cells.append(
            (
                "copy engines, contiguous ids+slots",
                lambda: dma(src, dst, ct),
                lambda: check(cids, cslots),
            )
        )
    return cells


def run_both(r: Run) -> None:
    """Save N blocks and load N others at once; the ceiling is two contiguous
    copies on two streams."""
    k, m = r.k, r.mem
    n = SIM_BOTH_N if r.sim else BOTH_N
    ia, ic, ib, sa, sb = paths.both_picks(r, n)
    ta, tb = m.save_t(ia, sa), m.load_t(ib, sb)
    fill = m.save_t(ic, sb)
    nb = n * m.slot_bytes

    def prepare() -> None:
        m.poison_pool()
        k.gather(m.eng, m.pool, fill, stream=r.s)
        k.synchronize(r.s)
        m.poison_back()

    save = (m.eng, m.pool, ta)
    load = (m.pool, m.eng_back, tb)
    w = LaunchShape("warp")

    def two(kw_a: dict, kw_b: dict) -> Callable[[], None]:
        def run() -> None:
            k.gather(*save, stream=r.s, **kw_a)
            k.scatter(*load, stream=r.s2, **kw_b)

        return run

    cap = {"max_blocks": r.cap}
    cells: list[tuple[str, Callable[[], None]]] = [
        ("block full grids, 2 streams", two({}, {})),
        (f"block cap {r.cap} each, 2 streams", two(cap, cap)),
        (
            f"warp cap {r.cap} each, 2 streams",
            two({"shape": w, **cap}, {"shape": w, **cap}),
        ),
        ("warp pair, one launch", lambda: k.copy_pair(save, load, stream=r.s)),
        (
            f"warp pair, one launch, grid=SMs ({r.sms})",
            lambda: k.copy_pair(save, load, stream=r.s, max_blocks=r.sms),
        ),
        (
            "warp pair, one launch, parts 4",
            lambda: k.copy_pair(
                save, load, stream=r.s, shape=LaunchShape("warp", parts=4)
            ),
        ),
    ]
    if not r.sim:
        ds, dl = paths.DmaPath("gather", r.s), paths.DmaPath("scatter", r.s2)
        cells += [
            ("copy engines both, 2 streams", lambda: (ds(*save), dl(*load))),
            (
                f"copy engines save + block load cap {r.cap}",
                lambda: (ds(*save), k.scatter(*load, stream=r.s2, **cap)),
            ),
            (
                f"block save cap {r.cap} + copy engines load",
                lambda: (k.gather(*save, stream=r.s, **cap), dl(*load)),
            ),
        ]
    streams = (r.s, r.s2)
    both_ok = lambda: m.check_both((ia, sa), (ib, sb))  # noqa: E731
    measure_both_ceiling(r, n)
    for name, run in cells:
        measure(r, "both", n, name, 2 * nb, run, both_ok, prepare, streams)


def measure_both_ceiling(r: Run, n: int) -> None:
    """Two contiguous copies of n blocks at once, one each way: the ceiling
    of the 'both' rows."""
    k, m = r.k, r.mem
    nb = n * m.slot_bytes

    def ceiling() -> None:
        m.ceiling("gather", nb, r.s)
        m.ceiling("scatter", nb, r.s2, pool_at=nb)

    def ceiling_ok() -> bool:
        return m.check_flat("gather", nb) and m.check_flat("scatter", nb, pool_at=nb)

    def prepare_flat() -> None:
        m.poison_pool()
        m.ceiling("gather", nb, r.s, pool_at=nb)  # the load's source bytes
        k.synchronize(r.s)
        m.poison_back()

    measure(
        r, "both", n, CEILING, 2 * nb, ceiling, ceiling_ok, prepare_flat, (r.s, r.s2)
    )


def run_latency(r: Run) -> None:
    """N = 1: P50 / P90 of the whole call until the host sees completion."""
    for op in ("gather", "scatter"):
        for name, make, ok in latency_cells(r, op):
            row: dict[str, Any] = {"op": f"lat_{op}", "variant": name, "N": 1}
            r.rows.append(row)
            if time.monotonic() > r.deadline:
                row.update(ok=None, skipped="time budget")
                continue
            try:
                row.update(time_latency(r, op, make, ok))
            except Exception as e:  # report, go on with the next call
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                sync_quietly(r)
            print(line(row), flush=True)
        if not r.sim:
            gpu_time_row(r, op)


def gpu_time_row(r: Run, op: str) -> None:
    """The block kernel's own device time at N = 1, and its launch call's."""
    from benchmarks.kernel_variants_launch import gpu_time_us

    m = r.mem
    ids, slots = r.pick(1)
    gather = op == "gather"
    t = m.save_t(ids, slots) if gather else m.load_t(ids, slots)
    src, dst = (m.eng, m.pool) if gather else (m.pool, m.eng_back)
    row: dict[str, Any] = {"op": f"gpu_{op}", "variant": "block kernel", "N": 1}
    r.rows.append(row)
    try:
        row.update(gpu_time_us(r.k, src, dst, t, r.s, LAT_REPS))
    except Exception as e:  # report, go on
        row.update(error=f"{type(e).__name__}: {e}"[:300])
        sync_quietly(r)
    print(row, flush=True)


def latency_cells(
    r: Run, op: str
) -> list[tuple[str, Callable[[], paths.Call], Callable[[], bool]]]:
    m = r.mem
    gather = op == "gather"
    ids, slots = r.pick(1)
    t = m.save_t(ids, slots) if gather else m.load_t(ids, slots)
    src, dst = (m.eng, m.pool) if gather else (m.pool, m.eng_back)
    check = m.check_gather if gather else m.check_scatter

    def ok() -> bool:
        return check(ids, slots)

    def flat_ok() -> bool:
        return m.check_flat(op, m.slot_bytes)

    calls = paths.latency_calls(r.k, op, src, dst, t, r.s, m, r.sim)
    return [(n, make, flat_ok if n.startswith("ceiling") else ok) for n, make in calls]


def time_latency(
    r: Run, op: str, make: Callable[[], paths.Call], ok: Callable[[], bool]
) -> dict[str, Any]:
    poison = r.mem.poison_pool if op == "gather" else r.mem.poison_back
    reps = SIM_LAT_REPS if r.sim else LAT_REPS
    poison()
    call = make()  # may capture a graph: before the first check
    call()
    first = ok()
    times = []
    for i in range(reps):
        if i == reps - 1:
            poison()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    p50, p90 = np.percentile(np.array(times) * 1e6, [50, 90])
    return {
        "ok": bool(first and ok()),
        "reps": reps,
        "p50_us": float(p50),
        "p90_us": float(p90),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument(
        "--sizes", default=None, help="comma list of N (default 1,8,64,640,2560)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=240.0, help="skip cells after this"
    )
    ap.add_argument(
        "--simulate", action="store_true", help="numba's CUDA simulator, tiny shapes"
    )
    ap.add_argument(
        "--only", default="latency,gather,scatter,both", help="parts to run, comma list"
    )
    args = ap.parse_args(argv)
    default = SIM_SIZES if args.simulate else SIZES
    args.sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else default
    args.only = set(args.only.split(","))
    if not args.only <= {"latency", "gather", "scatter", "both"}:
        ap.error(f"--only: {args.only}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.simulate:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba.cuda is imported
    t0 = time.monotonic()
    r = paths.open_run(args.simulate, t0 + args.budget_s)
    print(f"setup {time.monotonic() - t0:.1f} s, {r.sms} SMs", flush=True)
    if "latency" in args.only:
        run_latency(r)
    for op in ("gather", "scatter"):
        if op in args.only:
            run_direction(r, op, args.sizes)
    if "both" in args.only:
        run_both(r)
    paths.add_ratios(r.rows)
    meta = {
        **paths.versions(args.simulate),
        "sms": r.sms,
        "seconds": time.monotonic() - t0,
    }
    if args.json:
        write_json("kernel_variants", {"meta": meta, "rows": r.rows}, str(args.json))
    print(paths.tables(r.rows, args.sizes))
    bad = [x for x in r.rows if x.get("ok") is False]
    print(
        f"bytes ok: all {sum(x.get('ok') is True for x in r.rows)} checked cells"
        if not bad
        else f"FAILED or errored: {len(bad)} cells (see above)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
