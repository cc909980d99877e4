"""How much slower the same work runs right after the thread was idle
(issue 12): a request's Python path and a 1-block GPU copy timed back to back
and after an idle gap, the gap spent asleep, spinning, or asleep beside a
nice-19 spinner on the same core (which keeps the core from idling).

On the H200 host (2026-12-02, seventh session) the server's 1-block load copy
took 275 µs (P50, phase_trace.py) where the same copier took 138 µs called
back to back, and a metaserver handler 164 µs back to back against 322 µs
after a 1 ms sleep: this tells whether an idle core (a virtual CPU that
halted) or the work itself is the difference.

    python3 benchmarks/idle_gap.py [--gaps-us 0,100,300,1000] [--cpu-only]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from benchmarks.common import table, write_json  # noqa: E402

GAP_KINDS = ("sleep", "spin", "20 us sleeps", "sleep, spinner on the core")


def python_work() -> Callable[[], None]:
    """The kind of host work one 1-block request does: a descriptor table for
    32 layers from numpy metadata, a few dict and attribute lookups."""
    from benchmarks.kernel_variants_mem import LLAMA
    from pegaflow.common.geometry import KVGeometry

    geo = KVGeometry(LLAMA.layout(), [1 << 40])
    slots = np.uint64(1 << 30) + np.array([12345], np.uint64) * np.uint64(
        geo.slot_bytes
    )
    ids = np.array([7])
    counts: dict[str, int] = {}

    def run() -> None:
        geo.slots_to_engine(slots, ids)
        counts["load"] = counts.get("load", 0) + 1

    return run


def gpu_work() -> Callable[[], None]:
    """The server's CudaCopyEngine loading one block x 32 layers of 64 KiB
    pages, on this thread (benchmarks/copier_direct.py's setup)."""
    from benchmarks import kernel_variants_paths as paths
    from benchmarks.copier_direct import copier_for, regions_of

    r = paths.open_run(False, time.monotonic() + 600)
    m = r.mem
    copier = copier_for(m.pool.address, m.pool.nbytes)
    reg_back = regions_of(copier, r.k, m.back.data_ptr(), m.engine.numel())
    t = m.load_t(np.array([3]), np.array([5], np.uint64))
    return lambda: copier.scatter(reg_back, t)


def gap_call(kind: str, gap_s: float) -> Callable[[], None]:
    if gap_s <= 0:
        return lambda: None
    if kind == "spin":

        def spin() -> None:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass

        return spin
    if kind == "20 us sleeps":

        def naps() -> None:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                time.sleep(20e-6)

        return naps
    return lambda: time.sleep(gap_s)


@contextmanager
def spinner_beside(kind: str) -> Iterator[None]:
    """For the "spinner on the core" kind: this process and a nice-19 busy
    loop pinned to one core, so it never idles while this thread sleeps."""
    if "spinner" not in kind:
        yield
        return
    before = os.sched_getaffinity(0)
    core = max(before)
    os.sched_setaffinity(0, {core})
    proc = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(core),
            "nice",
            "-n",
            "19",
            "sh",
            "-c",
            "while :; do :; done",
        ]
    )
    try:
        time.sleep(0.2)
        yield
    finally:
        proc.kill()
        proc.wait()
        os.sched_setaffinity(0, before)


def timed_after_gaps(
    work: Callable[[], None], gap: Callable[[], None], reps: int
) -> list[float]:
    for _ in range(5):
        work()
    times = []
    for _ in range(reps):
        gap()
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gaps-us", default="0,100,300,1000")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--cpu-only", action="store_true", help="no GPU copy row")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    gaps = [int(g) for g in args.gaps_us.split(",")]
    works: dict[str, Callable[[], None]] = {"python, 1-block table": python_work()}
    if not args.cpu_only:
        works["copier, 1-block load"] = gpu_work()
    rows: list[dict[str, Any]] = []
    for kind in GAP_KINDS:
        with spinner_beside(kind):
            for name, work in works.items():
                for gap_us in gaps:
                    if gap_us == 0 and kind != GAP_KINDS[0]:
                        continue  # back to back is one row
                    got = timed_after_gaps(
                        work, gap_call(kind, gap_us * 1e-6), args.reps
                    )
                    us = np.asarray(got) * 1e6
                    row = {
                        "work": name,
                        "gap": "none" if gap_us == 0 else f"{gap_us} us {kind}",
                        "p50_us": round(float(statistics.median(us)), 1),
                        "p90_us": round(float(np.percentile(us, 90)), 1),
                        "min_us": round(float(us.min()), 1),
                    }
                    rows.append(row)
                    print(row, flush=True)
    print(table(rows, list(rows[0])))
    if args.json:
        write_json("idle_gap", {"rows": rows}, str(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
