"""Where a 1-block kernel copy's host time goes: the block-kernel path of
pegaflow.kernels.cuda (plan, table, launch, sync) called in a loop under
cProfile, N = 1 x 32 layers of 64 KiB, both directions; the top functions
by own time per call. A GPU host only.

    PYTHONPATH=$PWD python3 benchmarks/launch_profile.py --reps 3000
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from benchmarks import kernel_variants_paths as paths  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    r = paths.open_run(False, time.monotonic() + 600)
    m, k = r.mem, r.k
    for op in ("gather", "scatter"):
        ids, slots = r.pick(1)
        t = m.save_t(ids, slots) if op == "gather" else m.load_t(ids, slots)
        src, dst = (m.eng, m.pool) if op == "gather" else (m.pool, m.eng_back)
        copy = k.gather if op == "gather" else k.scatter

        def call(copy=copy, src=src, dst=dst, t=t) -> None:  # this op's
            copy(src, dst, t, stream=r.s)
            k.synchronize(r.s)

        for _ in range(200):
            call()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            call()
        prof.disable()
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out).sort_stats("tottime")
        st.print_stats(args.top)
        p50 = np.median(times) * 1e6
        print(f"== {op}: P50 {p50:.1f} us unprofiled; profile of {args.reps} calls")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
