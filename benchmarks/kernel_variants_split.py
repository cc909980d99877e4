"""One direction's batch split between SMs and copy engines at once (issue 12).

No kernel variant passed 0.92 of the pinned ceiling on the H200 (2026-12-02,
RESULTS.md "copy strategies compared"), nor did copy engines over scattered
64 KiB pages (0.70-0.80). Both move the same PCIe link by different hardware:
the kernel's stores come from the SMs, the copy engines' from their own
queues. This asks whether the two together fill the link better than either
alone: the first share `f` of a batch's blocks goes to cuMemcpyBatchAsync on
one stream, the rest to the block kernel on another, launched back to back,
timed until both streams finished; the same for saves and loads at once
(each direction's kernel capped at 66 CTAs, each with its own DMA share and
stream), and copy engines alone over two streams (two engines?).

Every cell byte-checked as in kernel_variants.py (poisoned destination, the
first and the last repetition). Under --simulate the copy-engine share runs
as a second kernel launch (the simulator has no copy engines): a check of the
harness and the split's bookkeeping, not of speed.

    PYTHONPATH=$PWD python3 benchmarks/kernel_variants_split.py --json $OUT/split.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from benchmarks import kernel_variants_paths as paths  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from benchmarks.kernel_variants import measure, measure_both_ceiling  # noqa: E402
from benchmarks.kernel_variants_paths import CEILING, Run  # noqa: E402

SIZES, SIM_SIZES = (64, 640, 2560), (4,)
SHARES, SIM_SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 1.0), (0.0, 0.5, 1.0)
BOTH_SHARES, SIM_BOTH_SHARES = (0.0, 0.2, 0.35, 0.5), (0.0, 0.5)
BOTH_N, SIM_BOTH_N = 640, 3


class Side:
    """One direction's copies: the kernel call, the copy-engine call (a kernel
    on the second stream under the simulator) and its transfers."""

    def __init__(self, r: Run, op: str, dma_stream: Any) -> None:
        m, k = r.mem, r.k
        self.gather = op == "gather"
        self.src, self.dst = (m.eng, m.pool) if self.gather else (m.pool, m.eng_back)
        self.kernel = k.gather if self.gather else k.scatter
        self.make_t = m.save_t if self.gather else m.load_t
        self.dma_stream = dma_stream
        if r.sim:
            self.dma = lambda s, d, t: self.kernel(s, d, t, stream=dma_stream)
        else:
            self.dma = paths.DmaPath(op, dma_stream)

    def call(
        self, ids: np.ndarray, slots: np.ndarray, share: float, stream: Any, **kw: Any
    ) -> Callable[[], None]:
        """The first round(share * N) blocks by copy engines, the rest by kernel."""
        cut = round(len(ids) * share)
        td = self.make_t(ids[:cut], slots[:cut]) if cut else None
        tk = self.make_t(ids[cut:], slots[cut:]) if cut < len(ids) else None

        def run() -> None:
            if td is not None:
                self.dma(self.src, self.dst, td)
            if tk is not None:
                self.kernel(self.src, self.dst, tk, stream=stream, **kw)

        return run

    def two_dma(
        self, ids: np.ndarray, slots: np.ndarray, other: Any
    ) -> Callable[[], None]:
        """Copy engines alone, half the blocks on each of two streams."""
        half = len(ids) // 2
        ta = self.make_t(ids[:half], slots[:half])
        tb = self.make_t(ids[half:], slots[half:])
        if isinstance(self.dma, paths.DmaPath):
            second = paths.DmaPath("gather" if self.gather else "scatter", other)
        else:
            second = lambda s, d, t: self.kernel(s, d, t, stream=other)  # noqa: E731

        def run() -> None:
            self.dma(self.src, self.dst, ta)
            second(self.src, self.dst, tb)

        return run


def run_direction(
    r: Run, op: str, sizes: tuple[int, ...], shares: tuple[float, ...]
) -> None:
    m = r.mem
    if op == "scatter":
        m.randomize_pool()
    poison = m.poison_pool if op == "gather" else m.poison_back
    check = m.check_gather if op == "gather" else m.check_scatter
    side = Side(r, op, r.s2)
    streams = (r.s, r.s2)
    for n in sizes:
        nb = n * m.slot_bytes
        ids, slots = r.pick(n)
        ok = lambda ids=ids, slots=slots: check(ids, slots)  # noqa: E731
        flat = lambda nb=nb: m.check_flat(op, nb)  # noqa: E731
        measure(r, op, n, CEILING, nb, lambda nb=nb: m.ceiling(op, nb, r.s), flat,
                poison, streams)  # fmt: skip
        for share in shares:
            name = f"dma {share:.0%} + kernel" if 0 < share < 1 else (
                "kernel alone" if share == 0 else "copy engines alone")  # fmt: skip
            measure(r, op, n, name, nb, side.call(ids, slots, share, r.s), ok, poison,
                    streams)  # fmt: skip
        measure(r, op, n, "copy engines, 2 streams", nb, side.two_dma(ids, slots, r.s),
                ok, poison, streams)  # fmt: skip


def run_both(r: Run, shares: tuple[float, ...]) -> None:
    """A save of N blocks and a load of N others at once, each direction's
    kernel capped (as in the server) with its own copy-engine share."""
    k, m = r.k, r.mem
    n = SIM_BOTH_N if r.sim else BOTH_N
    ia, ic, ib, sa, sb = paths.both_picks(r, n)
    fill = m.save_t(ic, sb)
    nb = n * m.slot_bytes
    s3, s4 = k.stream(), k.stream()
    save, load = Side(r, "gather", s3), Side(r, "scatter", s4)
    streams = (r.s, r.s2, s3, s4)

    def prepare() -> None:
        m.poison_pool()
        k.gather(m.eng, m.pool, fill, stream=r.s)
        k.synchronize(r.s)
        m.poison_back()

    def ok() -> bool:
        return m.check_both((ia, sa), (ib, sb))

    cap = {"max_blocks": r.cap}
    for share in shares:
        a = save.call(ia, sa, share, r.s, **cap)
        b = load.call(ib, sb, share, r.s2, **cap)
        run = lambda a=a, b=b: (a(), b())  # noqa: E731
        name = f"kernels cap {r.cap} + dma {share:.0%} each way"
        measure(r, "both", n, name, 2 * nb, run, ok, prepare, streams)
    a = save.call(ia, sa, 0.0, r.s)
    b = load.call(ib, sb, 1.0, r.s2)
    measure(r, "both", n, "save kernel full grid + load copy engines", 2 * nb,
            lambda: (a(), b()), ok, prepare, streams)  # fmt: skip
    a = save.call(ia, sa, 1.0, r.s)
    b = load.call(ib, sb, 0.0, r.s2)
    measure(r, "both", n, "save copy engines + load kernel full grid", 2 * nb,
            lambda: (a(), b()), ok, prepare, streams)  # fmt: skip


def both_ceiling(r: Run) -> None:
    """Two contiguous copies at once, for the 'both' rows' ratio."""
    measure_both_ceiling(r, SIM_BOTH_N if r.sim else BOTH_N)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args(argv)
    if args.simulate:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    t0 = time.monotonic()
    r = paths.open_run(args.simulate, t0 + args.budget_s)
    sizes = SIM_SIZES if r.sim else SIZES
    shares = SIM_SHARES if r.sim else SHARES
    for op in ("gather", "scatter"):
        run_direction(r, op, sizes, shares)
    both_ceiling(r)
    run_both(r, SIM_BOTH_SHARES if r.sim else BOTH_SHARES)
    paths.add_ratios(r.rows)
    meta = {**paths.versions(r.sim), "sms": r.sms, "seconds": time.monotonic() - t0}
    if args.json:
        write_json(
            "kernel_variants_split", {"meta": meta, "rows": r.rows}, str(args.json)
        )
    print(paths.tables(r.rows, sizes))
    bad = [x for x in r.rows if x.get("ok") is False]
    print(
        f"FAILED or errored: {len(bad)} cells"
        if bad
        else "bytes ok: every checked cell"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
