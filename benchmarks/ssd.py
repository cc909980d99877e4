"""SSD tier: sustained spill (write) and load (read) GB/s vs block size and queue
depth, next to dd with O_DIRECT on the same disk in the same run; the CPU cost of
the payload checksum; index recovery time for 100k blocks.

    python benchmarks/ssd.py                       # full run, files in /var/tmp
    python benchmarks/ssd.py --dir /mnt/nvme/x     # on another disk
    python benchmarks/ssd.py --quick               # small, for a smoke check
    python benchmarks/ssd.py --backend kvikio      # kvikio's CuFile (H200 machine)

JSON: benchmarks/results/ssd.json (full, posix), ssd_<backend>.json for another
backend, ssd_quick*.json for --quick (never over the full results), or --json.
It is rewritten (atomically) after every stage and row, with "stage" naming the
last one done and "complete" false until the end, so a run cut short (SIGTERM,
^C, a stage limit) keeps what it measured.

Each row is `--reps` pairs (default 3) of dd and the tier on the same number of
bytes, alternating which goes first; dd writes with O_DIRECT in DD_BS requests
(the tier's largest request) to a preallocated file, as the tier's files are,
and both writes end with an fdatasync. A row reports the medians and the range
of the per-pair ratios. A calibration before the rows gives dd against its
block size. `--skew N` puts the source blocks and the load targets N bytes off
4 KiB alignment, so the writers stage them through a copy instead of writing
them in place, and the readers read through a bounce buffer instead of straight
into the targets.

Queue depth = writer threads for spills, reader threads for loads: the number of
record I/Os in flight. Every loaded block is checked by the tier against its
64-bit checksum; the first batch of every row is also compared byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from pegaflow.common.keys import namespace_digest  # noqa: E402
from pegaflow.gds import SsdConfig, SsdTier  # noqa: E402
from pegaflow.gds.format import CHECKSUM_NAMES, ChecksumName, checksum_id, hasher

NS = namespace_digest("bench", (1,))
SOURCE_BYTES = 256 << 20  # the "pool": blocks cycle through it
MiB = 1 << 20
DD_BS = 16 * MiB  # = gds.tier.RUN_BYTES, the tier's largest request


def dd(
    folder: Path, nbytes: int, bs: int, streams: int = 1, prealloc: bool = True
) -> dict[str, float]:
    """dd's own O_DIRECT write then read of nbytes in bs-sized requests, GB/s;
    `streams` dd processes at once on disjoint ranges (one request in flight
    each), the wall time of the slowest. The target is preallocated
    (posix_fallocate) like the tier's cache files, so both pay the same
    conversion of unwritten extents on their first pass; the write's time
    includes an fdatasync, as the tier's does."""
    target = folder / "dd.bin"
    count = max(1, nbytes // bs // streams)
    if prealloc:
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, streams * count * bs)
        finally:
            os.close(fd)
    out = {}
    for name, args, at in (
        (
            "write",
            ["if=/dev/zero", f"of={target}", "oflag=direct", "conv=notrunc"],
            "seek",
        ),
        ("read", [f"if={target}", "of=/dev/null", "iflag=direct"], "skip"),
    ):
        t = time.perf_counter()
        procs = [
            subprocess.Popen(
                ["dd", f"bs={bs}", f"count={count}", f"{at}={k * count}", *args],
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(streams)
        ]
        for proc in procs:
            _, err = proc.communicate()
            assert proc.returncode == 0 and re.search(r"bytes .* copied", err), err
        if name == "write":
            subprocess.run(["sync", str(target)], check=True)
        out[name] = streams * count * bs / (time.perf_counter() - t) / 1e9
    target.unlink()
    return out


def remove(cfg: SsdConfig) -> None:
    """The cache files, their journal and their lock file."""
    for path in (*cfg.paths, cfg.journal_path, f"{cfg.paths[0]}.lock"):
        Path(path).unlink(missing_ok=True)


def cpu_ceilings(algo: str) -> dict[str, float]:
    """One thread: the payload checksum and a memcpy, GB/s (each byte of a spill
    or load goes through both once)."""
    buf = np.random.default_rng(0).integers(0, 256, 64 * MiB, np.uint8)
    dst = np.empty_like(buf)
    h = hasher(checksum_id(algo))  # type: ignore[arg-type]
    t = time.perf_counter()
    h(memoryview(buf))
    ck = buf.nbytes / (time.perf_counter() - t) / 1e9
    best = 0.0
    for _ in range(3):  # the first copy also faults dst in
        t = time.perf_counter()
        np.copyto(dst, buf)
        best = max(best, buf.nbytes / (time.perf_counter() - t) / 1e9)
    return {"checksum": ck, "memcpy": best}


def bench_row(
    folder: Path,
    source: np.ndarray,
    block: int,
    depth: int,
    total: int,
    algo: str,
    backend: str = "posix",
) -> dict[str, object]:
    n = max(depth * 4, total // block)
    cfg = SsdConfig(
        paths=(str(folder / "cache.bin"),),
        capacity_bytes=n * (block + 8192) + 64 * MiB,
        write_threads=depth,
        read_threads=depth,
        queue_blocks=n,
        checksum=algo,  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        show_progress=False,
    )
    per_src = source.nbytes // block
    addr = [int(source.ctypes.data) + (i % per_src) * block for i in range(n)]
    keys = [hashlib.blake2b(b"%d-%d-%d" % (block, depth, i)).digest() for i in range(n)]
    tier = SsdTier(cfg)
    try:
        t = time.perf_counter()
        for i in range(n):
            assert tier.spill(NS, keys[i], [addr[i]], block)
        tier.flush()
        tier.store.io.sync()  # as dd's write is followed by a sync
        write_s = time.perf_counter() - t
        assert tier.stats().blocks_written == n, tier.stats()
        batch = min(n, 64)
        # load targets: page-aligned like the pool's slots (read in place), or
        # as far off alignment as the source (--skew: through the bounce buffer)
        # One slot per block, as the pool gives each loading block its own:
        # with reads in place, two reads in flight must not share a slot (a
        # slot being hashed while another read lands in it reads as damage).
        # Touched before the clock starts, as the pool's pages are.
        skew = int(source.ctypes.data) % 4096
        dst_region = mmap.mmap(-1, n * block + 4096)
        dst = np.frombuffer(dst_region, np.uint8)[skew : skew + n * block]
        dst[::4096] = 0
        slots = dst.ctypes.data + np.arange(n, dtype=np.uint64) * block
        first = tier.load(NS, keys[:batch], slots[:batch], block).result()
        assert first.ok.all()
        for i in range(batch):  # the first batch, byte for byte
            src = source[(i % per_src) * block : (i % per_src + 1) * block]
            assert np.array_equal(dst[i * block : (i + 1) * block], src)
        t = time.perf_counter()
        res = tier.load(NS, keys, slots, block).result()
        read_s = time.perf_counter() - t
        assert res.ok.all() and tier.stats().checksum_failures == 0
        mode = tier.mode
    finally:
        tier.close()
        remove(cfg)
    nbytes = n * block
    return {
        "block_KiB": block >> 10,
        "depth": depth,
        "GiB": round(nbytes / (1 << 30), 2),
        "write_GBps": round(nbytes / write_s / 1e9, 3),
        "read_GBps": round(nbytes / read_s / 1e9, 3),
        "mode": mode,
    }


def bench_recovery(
    folder: Path, n: int, payload: int, backend: str = "posix"
) -> dict[str, float]:
    """Spill n small blocks for real, close, time the reopen from the journal;
    then delete the journal and time the reopen by scanning the record headers."""
    cfg = SsdConfig(
        paths=(str(folder / "recover.bin"),),
        capacity_bytes=n * (payload + 4096) + 64 * MiB,
        queue_blocks=4096,
        backend=backend,  # type: ignore[arg-type]
        show_progress=False,
    )
    src = np.random.default_rng(2).integers(0, 256, payload, np.uint8)
    keys = [i.to_bytes(8, "little") for i in range(n)]
    tier = SsdTier(cfg)
    t = time.perf_counter()
    for i in range(n):
        while not tier.spill(NS, keys[i], [int(src.ctypes.data)], payload):
            tier.flush()  # queue full: let the writers catch up
    tier.close()
    write_s = time.perf_counter() - t
    out: dict[str, float] = {"blocks": n, "spill_s": round(write_s, 2)}
    for how in ("journal", "scan"):
        if how == "scan":
            Path(cfg.journal_path).unlink()
        t = time.perf_counter()
        tier = SsdTier(cfg)
        out[f"recover_{how}_s"] = round(time.perf_counter() - t, 3)
        rec = tier.store.recovery
        hits = tier.lookup(NS, keys)
        dst = np.zeros((3, payload), np.uint8)
        some = [keys[0], keys[n // 2], keys[-1]]
        slots = np.array([[int(row.ctypes.data)] for row in dst], np.uint64)
        ok = tier.load(NS, some, slots, payload).result().ok
        tier.close()
        assert rec.rebuilt_by == how and rec.blocks == hits == n, (rec, hits)
        assert ok.all() and (dst == src).all()
    remove(cfg)
    out["recover_s"] = out["recover_journal_s"]  # the key of earlier results
    return out


def calibrate(folder: Path, total: int, reps: int) -> list[dict[str, object]]:
    """dd against its block size (preallocated target, as the per-row dd), and
    once without preallocation (how dd ran before run 3): medians of reps,
    the sizes interleaved so drift spreads over all of them."""
    runs: dict[tuple[int, bool], list[dict[str, float]]] = {}
    cases = [(bs * MiB, True) for bs in (1, 4, 16, 64)] + [(DD_BS, False)]
    for _ in range(reps):
        for bs, pre in cases:
            runs.setdefault((bs, pre), []).append(dd(folder, total, bs, prealloc=pre))
    return [
        {
            "bs_MiB": bs >> 20,
            "prealloc": pre,
            "write_GBps": round(statistics.median(r["write"] for r in got), 3),
            "read_GBps": round(statistics.median(r["read"] for r in got), 3),
            "reps": [(round(r["write"], 3), round(r["read"], 3)) for r in got],
        }
        for (bs, pre), got in runs.items()
    ]


def paired_row(
    folder: Path,
    source: np.ndarray,
    block: int,
    depth: int,
    total: int,
    algo: str,
    backend: str,
    reps: int,
) -> dict[str, object]:
    """reps pairs of (dd, tier) on the same bytes, alternating which goes first
    (ABBA: a drift within a pair falls on both sides equally often). Each
    pair gives a ratio; the row reports medians and the ratios' range."""
    pairs = []
    for rep in range(reps):
        n = max(depth * 4, total // block)
        if rep % 2 == 0:
            ceiling = dd(folder, n * block, DD_BS)
            ours = bench_row(folder, source, block, depth, total, algo, backend)
        else:
            ours = bench_row(folder, source, block, depth, total, algo, backend)
            ceiling = dd(folder, n * block, DD_BS)
        pairs.append((ours, ceiling))
    row = dict(pairs[0][0])
    for op in ("write", "read"):
        mine = [o[f"{op}_GBps"] for o, _ in pairs]
        theirs = [c[op] for _, c in pairs]
        ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
        row[f"{op}_GBps"] = round(statistics.median(mine), 3)
        row[f"dd_{op}_GBps"] = round(statistics.median(theirs), 3)
        row[f"{op}/dd"] = round(statistics.median(ratios), 2)
        row[f"{op}/dd_min"] = round(min(ratios), 2)
        row[f"{op}/dd_max"] = round(max(ratios), 2)
        row[f"{op}_reps"] = [
            (round(m, 3), round(t, 3)) for m, t in zip(mine, theirs, strict=True)
        ]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp/pegaflow-ssd-bench", help="scratch dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--checksum", default="auto", choices=get_args(ChecksumName))
    p.add_argument("--total", default=None, help="GiB per row (default 1, quick 0.25)")
    p.add_argument("--backend", default="posix", choices=("posix", "kvikio", "auto"))
    p.add_argument("--recovery-blocks", type=int, default=None, help="default 100k")
    p.add_argument(
        "--reps", type=int, default=None, help="dd/tier pairs per row (default 3)"
    )
    p.add_argument("--blocks", default=None, help="block sizes in KiB, comma-separated")
    p.add_argument("--depths", default=None, help="queue depths, comma-separated")
    p.add_argument("--skip-recovery", action="store_true")
    p.add_argument(
        "--skew",
        type=int,
        default=0,
        help="bytes past 4 KiB alignment of every source block (not 0: the "
        "writers stage blocks through a buffer instead of writing from them)",
    )
    p.add_argument("--json", help="output path (default: see the module docstring)")
    args = p.parse_args()
    try:
        algo = CHECKSUM_NAMES[checksum_id(args.checksum)]
    except ValueError as exc:
        p.error(str(exc))
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    name = "ssd" + ("_quick" if args.quick else "")
    name += "" if args.backend == "posix" else f"_{args.backend}"
    results: dict[str, object] = {
        "command": " ".join(sys.argv),
        "backend": args.backend,
        "checksum": algo,
        "skew": args.skew,
        "dd_bs": DD_BS,
        "complete": False,
        "stage": "start",
        "rows": [],
    }

    def save(stage: str) -> None:
        results["stage"] = stage
        print(f"wrote {write_json(name, results, args.json)} ({stage})", flush=True)

    # SIGTERM (a stage limit, `timeout`) unwinds like ^C: the finally below
    # writes what was measured so far.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_stages(args, algo, folder, results, save)
        results["complete"] = True
    except KeyboardInterrupt:
        print(f"interrupted in stage {results['stage']}", file=sys.stderr)
        results["interrupted_in"] = results["stage"]
        return 130
    finally:
        save("done" if results["complete"] else "interrupted")
    report(results)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_stages(
    args: argparse.Namespace,
    algo: str,
    folder: Path,
    results: dict[str, object],
    save: Callable[[str], None],
) -> None:
    """Every stage adds to `results` and saves the JSON when it ends (each row
    of the paired stage too), so a run cut short keeps what it measured."""
    total = int(float(args.total or (0.25 if args.quick else 1)) * (1 << 30))
    blocks = (
        [256 << 10, 2 * MiB] if args.quick else [256 << 10, 1 * MiB, 2 * MiB, 8 * MiB]
    )
    depths = [1, 4] if args.quick else [1, 2, 4, 8]
    if args.blocks:
        blocks = [int(b) << 10 for b in args.blocks.split(",")]
    if args.depths:
        depths = [int(d) for d in args.depths.split(",")]
    args.reps = args.reps or (1 if args.quick else 3)
    results["reps"] = args.reps
    # page-aligned like the server's pool (one mmap'd region)
    region = mmap.mmap(-1, SOURCE_BYTES + 4096)
    source = np.frombuffer(region, np.uint8)[args.skew : args.skew + SOURCE_BYTES]
    source[:] = np.random.default_rng(1).integers(0, 256, SOURCE_BYTES, np.uint8)
    # The ceiling: dd with O_DIRECT on the same disk, bs = DD_BS (the tier's
    # request size: a writer sends up to RUN_BYTES per request). The calibration
    # shows dd against its block size, so the choice can be checked.
    results["cpu_one_thread"] = {a: cpu_ceilings(a) for a in sorted({algo, "blake2b"})}
    save("cpu")
    results["dd_calibration"] = calibrate(folder, total, args.reps)
    save("dd_calibration")
    rows = results["rows"]
    assert isinstance(rows, list)
    for block in blocks:
        for depth in depths:
            r = paired_row(
                folder, source, block, depth, total, algo, args.backend, args.reps
            )
            rows.append(r)
            save(f"row {block >> 10} KiB x{depth}")
            print(
                f"{block >> 10} KiB x{depth}: write {r['write_GBps']} "
                f"(dd {r['dd_write_GBps']}, ratio {r['write/dd']} "
                f"[{r['write/dd_min']}-{r['write/dd_max']}]), read "
                f"{r['read_GBps']} (dd {r['dd_read_GBps']}, ratio {r['read/dd']} "
                f"[{r['read/dd_min']}-{r['read/dd_max']}])",
                flush=True,
            )
    results["dd"] = {"dd_16M_x4": dd(folder, total, DD_BS, streams=4)}
    save("dd")
    n = args.recovery_blocks or (20_000 if args.quick else 100_000)
    results["recovery"] = (
        {} if args.skip_recovery else bench_recovery(folder, n, 4096, args.backend)
    )
    save("recovery")
    folder.rmdir() if not any(folder.iterdir()) else None


def report(results: dict[str, Any]) -> None:
    rows, recovery = results["rows"], results["recovery"]
    cols = ["block_KiB", "depth", "GiB", "write_GBps", "dd_write_GBps", "write/dd"]
    cols += ["write/dd_min", "write/dd_max", "read_GBps", "dd_read_GBps", "read/dd"]
    print(table(rows, [*cols, "read/dd_min", "read/dd_max"]))
    calib = results["dd_calibration"]
    print(table(calib, ["bs_MiB", "prealloc", "write_GBps", "read_GBps", "reps"]))
    for name, c in results["dd"].items():
        print(
            f"{name} O_DIRECT: write {c['write']:.3f} GB/s, read {c['read']:.3f} GB/s"
        )
    for a, c in results["cpu_one_thread"].items():
        print(
            f"{a} checksum {c['checksum']:.2f} GB/s, memcpy "
            f"{c['memcpy']:.2f} GB/s (one thread)"
        )
    if recovery:
        print(
            f"index recovery of {recovery['blocks']} blocks: journal "
            f"{recovery['recover_journal_s']} s, header scan "
            f"{recovery['recover_scan_s']} s (spilling them took "
            f"{recovery['spill_s']} s)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
