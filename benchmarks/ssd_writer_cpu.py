"""The SSD writer threads' CPU per block, the write syscall stubbed: what a
writer holds the GIL for (checksum excepted: it runs a run at a time in one
compiled call without the GIL, pegaflow.common.checksum_rows), which the save path's
threads lose while write-behind runs.

One writer thread writes `--mib` of blocks spilled 64 at a time from an aligned
pool (every slot 4 KiB-aligned: a GPU engine's, written in place) or, with
`--skew 16`, from slots 16 bytes past a page (a host engine whose KV cache
numpy or torch allocated: its slots share that offset, so the writer stages
them through its aligned buffer); os.pwritev is replaced by a
stub that reports every byte written, so the time is the writer's Python and C
work (gather, header pages, journal entries, index) plus the payload checksum,
which is measured alone over the same blocks, the same way, and reported
apart (before 2026-12-04 it was one python-xxhash call per block, on both
sides).

    python benchmarks/ssd_writer_cpu.py                  # 64 KiB and 256 KiB
    python benchmarks/ssd_writer_cpu.py --reps 5 --shards 2
    python benchmarks/ssd_writer_cpu.py --skew 16        # the staged path

JSON: benchmarks/results/ssd_writer_cpu.json (or --json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from pegaflow.common import checksum_rows  # noqa: E402
from pegaflow.gds import SsdConfig, SsdTier  # noqa: E402
from pegaflow.gds import tier as tier_module  # noqa: E402
from pegaflow.gds.io import AlignedBuffer, host_view  # noqa: E402

NS = b"\x01" * 16
SPILL_BLOCKS = 64


def measure(
    block_bytes: int, shards: int, total: int, where: str, skew: int = 0
) -> dict[str, object]:
    """One tier, one writer: CPU µs (the thread's own, so other processes on a
    shared machine do not count) of _write_batch per block, and of xxh3 alone."""
    n = max(SPILL_BLOCKS, total // block_bytes)
    each = block_bytes // shards
    pool = AlignedBuffer(n * block_bytes + 4096)
    host_view(pool.address, n * block_bytes)[:] = np.random.bytes(n * block_bytes)
    slots = pool.address + skew + np.arange(n * shards, dtype=np.uint64) * each
    slots = slots.reshape(n, shards)
    hashes = [os.urandom(32) for _ in range(n)]
    spent: list[float] = []
    real_batch = tier_module.SsdTier._write_batch

    def timed(self: SsdTier, slices: list, buf: AlignedBuffer) -> None:
        start = time.thread_time()
        real_batch(self, slices, buf)
        spent.append(time.thread_time() - start)

    real_pwritev = os.pwritev
    Path(where).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where) as d:
        cfg = SsdConfig(
            (f"{d}/cache.bin",),
            n * (block_bytes + 4096) + (64 << 20),
            backend="posix",
            queue_blocks=n,
            write_threads=1,
            show_progress=False,
        )
        tier = SsdTier(cfg)
        tier_module.SsdTier._write_batch = timed  # type: ignore[method-assign]
        os.pwritev = lambda fd, views, offset: sum(map(len, views))
        try:
            for i in range(0, n, SPILL_BLOCKS):
                tier.spill_many(
                    NS, hashes[i : i + SPILL_BLOCKS], slots[i : i + SPILL_BLOCKS], each
                )
            tier.flush()
        finally:
            os.pwritev = real_pwritev
            tier_module.SsdTier._write_batch = real_batch  # type: ignore[method-assign]
            tier.close()
    written = tier.stats().blocks_written
    # The checksum alone, as the writers compute it: a run's rows in one
    # call (pegaflow.common.checksum_rows), SPILL_BLOCKS rows a call.
    checksum_rows.warm()
    start = time.thread_time()
    for i in range(0, n, SPILL_BLOCKS):
        checksum_rows.rows(slots[i : i + SPILL_BLOCKS], each)
    xxh3 = (time.thread_time() - start) / n * 1e6
    pool.close()
    total_us = sum(spent) / written * 1e6
    return {
        "block_KiB": block_bytes >> 10,
        "shards": shards,
        "skew": skew,
        "blocks": written,
        "writer_us": round(total_us, 2),
        "xxh3_us": round(xxh3, 2),
        "rest_us": round(total_us - xxh3, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,256", help="block KiB, comma-separated")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--mib", type=int, default=512, help="bytes spilled per size")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/var/tmp", help="where the cache file goes")
    p.add_argument(
        "--skew", type=int, default=0, help="slot offset past a page, bytes (0..4095)"
    )
    p.add_argument("--json")
    args = p.parse_args()
    if not 0 <= args.skew < 4096:
        p.error(f"--skew: {args.skew}, need 0..4095")
    rows = []
    for rep in range(args.reps):
        for kib in (int(s) for s in args.sizes.split(",")):
            row = measure(kib << 10, args.shards, args.mib << 20, args.dir, args.skew)
            rows.append({"rep": rep, **row})
            print(rows[-1], flush=True)
    cols = ["rep", "block_KiB", "shards", "skew", "blocks", "writer_us", "xxh3_us"]
    cols += ["rest_us"]
    print(table(rows, cols))
    for kib in sorted({r["block_KiB"] for r in rows}):
        mine = [r for r in rows if r["block_KiB"] == kib]
        med = {
            k: float(np.median([r[k] for r in mine])) for k in ("writer_us", "rest_us")
        }
        print(
            f"{kib} KiB: median writer {med['writer_us']:.1f} us/block, "
            f"rest {med['rest_us']:.1f}"
        )
    out = write_json("ssd_writer_cpu", {"args": vars(args), "rows": rows}, args.json)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
