"""The descriptor table's checks before a launch, by batch size (issue 12).

A copy's host side checks every descriptor against its buffers and that no two
destinations overlap before the kernel may start; the GPU waits meanwhile.
This times that check (pegaflow.kernels.table_jit.checked_table, what the
server runs, and plan.descriptor_table, its numpy reference) on a real
geometry's tables: Llama-3.1-8B pages (32 layers x 64 KiB), an 8 GiB engine,
random engine blocks, the pool slots of a save in rising order (as the slab
allocator hands them out). No GPU needed.

    python benchmarks/table_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, table, write_json  # noqa: E402
from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment  # noqa: E402
from pegaflow.kernels import table_jit  # noqa: E402
from pegaflow.kernels.plan import Buffer, descriptor_table  # noqa: E402

LAYERS, BLOCKS, PAGE, SLOTS = 32, 4096, 64 << 10, 8192
ENGINE, POOL = 1 << 40, 1 << 44
REPS = 20


def best_us(fn, *args) -> float:  # noqa: ANN001 - any check
    fn(*args)
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="1,64,640,2560")
    args = ap.parse_args(argv)
    layout = tuple(
        LayerLayout(0, i * BLOCKS * PAGE, BLOCKS, PAGE, (Segment(0, PAGE),))
        for i in range(LAYERS)
    )
    geo = KVGeometry(layout, [ENGINE])
    engine = Buffer(ENGINE, ENGINE, LAYERS * BLOCKS * PAGE, None, None)
    pool = Buffer(POOL, POOL, SLOTS * geo.slot_bytes, None, None)
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        ids = rng.choice(BLOCKS, n, replace=False)
        slots = POOL + np.arange(n, dtype=np.uint64) * np.uint64(geo.slot_bytes)
        save = geo.engine_to_slots(ids, slots, np.arange(LAYERS))
        load = geo.slots_to_engine(slots, ids)
        ways = (("save", engine, pool, save), ("load", pool, engine, load))
        for way, src, dst, t in ways:
            rows.append({
                "N": n, "way": way, "descriptors": len(t),
                "compiled_us": round(best_us(table_jit.checked_table, src, dst, t), 1),
                "numpy_us": round(best_us(descriptor_table, src, dst, t), 1),
            })  # fmt: skip
            print(rows[-1], flush=True)
    print(table(rows, list(rows[0])))
    write_json("table_check", {"machine": machine(), "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
