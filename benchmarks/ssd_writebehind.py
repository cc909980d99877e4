"""Write-behind cost: host-path save GB/s with no SSD tier, with
--ssd-write-on evict and with --ssd-write-on seal (same pool, a working set
larger than the pool so L1 evicts), the SSD write GB/s each reached next to a
paired dd of the same bytes on the same disk, and the writes dropped (queue
full) under a save burst larger than the disk absorbs.

    python benchmarks/ssd_writebehind.py                 # files in /var/tmp
    python benchmarks/ssd_writebehind.py --quick         # small, a smoke check
    python benchmarks/ssd_writebehind.py --dir /mnt/nvme/x
    python benchmarks/ssd_writebehind.py --engine-align malloc,page
    python benchmarks/ssd_writebehind.py --layers 32     # 2 MiB blocks
    python benchmarks/ssd_writebehind.py --bursts 4      # steadier rows
    python benchmarks/ssd_writebehind.py --tier-arg=--ssd-write-inflight=1

--layers: 64 KiB pages per block. The default 4 (256 KiB blocks) is the
writers' worst case, as their bookkeeping is per block; 32 (2 MiB) is the
geometry of transfer.py's GPU rows, a Llama-8B-class model's block.

--engine-align: where the engine's KV buffer starts. `malloc` (the default,
numpy's own allocation: 16 bytes past a page, as a host engine's torch or
numpy KV cache is) gives the pool slots that offset, so the SSD writers
stage each block through their aligned buffer; `page` (a page-aligned
buffer, as pinned or GPU memory is) lets them write from the slots in place.

JSON: benchmarks/results/ssd_writebehind[_quick].json (or --json), rewritten
atomically after every mode.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import phase_trace  # noqa: E402
from benchmarks.common import metric_totals, table, write_json  # noqa: E402
from benchmarks.ssd import dd  # noqa: E402
from pegaflow.client.kv_layouts import describe, vllm_layer_views  # noqa: E402
from pegaflow.client.pegaflow_client import PegaflowClient  # noqa: E402
from pegaflow.demo.spawn import spawn_server  # noqa: E402
from pegaflow.kernels.plan import aligned_empty  # noqa: E402

SWITCH = Path(__file__).with_name("switch_interval.py")
# Where a save's copy and the SSD writers spend their time, and how much of it
# off the CPU: a copy thread's process_vm_readv that returns and then waits
# for the GIL (held by a writer's Python) shows as off-CPU time of `transfer`.
# The loop's own share shows in Engine.save beside _copy: reserve_save,
# finish_save (which hands sealed blocks to the tier: SsdLink.sealed) and the
# hand-back from the copy thread, which waits for the GIL like any thread.
TRACE_TARGETS = (
    "pegaflow.copiers.host_copier:transfer",
    "pegaflow.copiers.host_copier:HostCopyEngine._copy",
    "pegaflow.server.engine:Engine.save",
    "pegaflow.server.engine:Engine._copy",
    "pegaflow.cache.block_store:BlockStore.reserve_save",
    "pegaflow.cache.block_store:BlockStore.finish_save",
    "pegaflow.tiers.ssd_link:SsdLink.sealed",
    "pegaflow.gds.tier:SsdTier._write_batch",
)
MODES = ("none", "evict", "seal")

PAGE = 64 << 10
LAYERS = 4  # the default: one block = 4 x 64 KiB = 256 KiB
BATCH = 64  # blocks per save


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drained(http: str, timeout: float = 300.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metric_totals(http)
        if m.get("pegaflow_ssd_queue_depth", 0) == 0:
            return m
        time.sleep(0.02)
    raise RuntimeError("ssd queue did not drain")


def _burst(
    client: PegaflowClient, blocks: int, engine_blocks: int
) -> tuple[float, int]:
    """Save `blocks` fresh blocks, BATCH a call, walking the engine's buffer:
    (seconds, blocks stored)."""
    stored = 0
    start = time.perf_counter()
    for i in range(blocks // BATCH):
        hs = [secrets.token_bytes(32) for _ in range(BATCH)]
        first = i * BATCH % (engine_blocks - BATCH + 1)
        stored += client.save("b", np.arange(first, first + BATCH), hs).stored
    return time.perf_counter() - start, stored


def run_mode(
    mode: str,
    pool: str,
    blocks: int,
    folder: Path,
    switch_ms: float | None = None,
    engine_align: str = "malloc",
    trace: str | None = None,
    engine_blocks: int = 2 * BATCH,
    layers: int = LAYERS,
    bursts: int = 1,
    tier_args: tuple[str, ...] = (),
) -> dict[str, object]:
    """Save `blocks` fresh blocks in batches of BATCH as fast as one client
    can; the tier (if any) in `folder`. bursts > 1: as many more bursts of
    `blocks` fresh blocks, each once the SSD queue has drained, on a pool
    full from their first save; save_GBps is then their median (the first
    burst's figure stays in first_GBps), which leaves a server instance's
    passing stalls out of the figure. trace: run the server under
    phase_trace.py into this file (TRACE_TARGETS, their time off the CPU).
    engine_blocks: the engine's KV buffer in blocks; the saves walk through
    it, so past the CPU's caches (4,096 blocks: 1 GiB) each save reads cold
    memory, as an engine's does, where 128 (the first version's) saves the
    same 16 MiB every time, hot in the L3 unless the writers evict it.
    tier_args: more server flags for the modes with a tier."""
    http = f"127.0.0.1:{_free_port()}"
    args = ["--pool-size", pool, "--no-progress", "--http-addr", http]
    if mode != "none":
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        args += ["--ssd-cache-path", str(folder / "ssd0.bin")]
        args += ["--ssd-cache-capacity", f"{2 * blocks * layers * PAGE}"]
        args += ["--ssd-write-on", mode, "--ssd-backend", "posix", *tier_args]
    if trace:
        wrap = phase_trace.python_args(None, trace, TRACE_TARGETS, switch_ms)
    else:
        wrap = () if switch_ms is None else (str(SWITCH), str(switch_ms))
    proc, addr = spawn_server("--log-level", "warning", *args, python_args=wrap)
    size = layers * engine_blocks * PAGE
    buf = aligned_empty(size) if engine_align == "page" else np.empty(size, np.uint8)
    buf[:] = np.frombuffer(np.random.default_rng(0).bytes(buf.nbytes), np.uint8)
    views = vllm_layer_views(buf, layers, engine_blocks, (PAGE,))
    mem = describe(views)
    try:
        with PegaflowClient(addr, timeout_s=120) as client:
            client.register_host("b", "bench-wb", os.getpid(), mem.regions, mem.layers)
            t0 = time.perf_counter()
            save_s, stored = _burst(client, blocks, engine_blocks)
            m = _drained(http) if mode != "none" else metric_totals(http)
            drain_s = time.perf_counter() - t0
            more = []
            for _ in range(bursts - 1):
                took, got = _burst(client, blocks, engine_blocks)
                more.append(took)
                stored += got
                if mode != "none":
                    _drained(http)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    nbytes = blocks * layers * PAGE
    written = m.get("pegaflow_ssd_written_bytes_total", 0.0)
    row: dict[str, object] = {
        "mode": mode,
        "tier_args": " ".join(tier_args) if mode != "none" else "",
        "engine_align": engine_align,
        "block_KiB": layers * PAGE >> 10,
        "engine_MiB": size >> 20,
        "slot_skew": buf.ctypes.data % 4096,
        "GiB_saved": round(nbytes / (1 << 30), 2),
        "stored": stored,
        "save_GBps": round(nbytes / float(np.median(more or [save_s])) / 1e9, 3),
        "first_GBps": round(nbytes / save_s / 1e9, 3),
        "burst_GBps": [round(nbytes / t / 1e9, 3) for t in more],
        "evictions": int(m.get("pegaflow_evictions_total", 0)),
        "ssd_written_GiB": round(written / (1 << 30), 3),
        "ssd_write_GBps": round(written / drain_s / 1e9, 3) if written else 0.0,
        "dropped": int(m.get("pegaflow_ssd_spills_dropped_total", 0)),
        "refused_held": int(m.get("pegaflow_ssd_spills_refused_total", 0)),
    }
    if written:  # the paired ceiling: dd of the same bytes on the same disk
        row["dd_write_GBps"] = round(dd(folder, int(written), 16 << 20)["write"], 3)
        row["write/dd"] = round(float(row["ssd_write_GBps"]) / row["dd_write_GBps"], 2)
        shutil.rmtree(folder, ignore_errors=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp/pegaflow-wb-bench")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None, help="rounds of the 3 modes")
    p.add_argument("--json")
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES)
    )
    p.add_argument(
        "--switch-ms",
        default="",
        help="comma list of the server's GIL switch intervals to compare, ms "
        "(benchmarks/switch_interval.py; default: Python's 5 ms, unwrapped)",
    )
    p.add_argument(
        "--trace-dir",
        help="run each server under benchmarks/phase_trace.py, a trace per run "
        "here (the copy calls' and SSD writers' time, and its share off the CPU)",
    )
    p.add_argument(
        "--engine-align",
        default="malloc",
        help="comma list of malloc, page: where the engine's KV buffer starts",
    )
    p.add_argument(
        "--engine-blocks",
        default="128",
        help="comma list of the engine buffer's sizes in blocks: at 256 KiB "
        "blocks, 128 saves the same 16 MiB every time (hot in cache); 4096 walks "
        "1 GiB",
    )
    p.add_argument(
        "--bursts",
        type=int,
        default=1,
        help="save bursts per server (default 1); past 1, a row's save GB/s is "
        "the median of the bursts after the first (pool full, queue drained "
        "before each)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help="64 KiB pages per block (default 4: 256 KiB blocks, the writers' "
        "worst case; 32: 2 MiB, transfer.py's geometry)",
    )
    p.add_argument(
        "--tier-arg",
        action="append",
        default=[],
        help="a server flag for the modes with an SSD tier, as one word "
        "(--tier-arg=--ssd-write-inflight=1); repeatable",
    )
    args = p.parse_args()
    switches = [float(x) for x in args.switch_ms.split(",") if x] or [None]
    aligns = [a for a in args.engine_align.split(",") if a]
    if not aligns or set(aligns) - {"malloc", "page"}:
        p.error(f"--engine-align: {args.engine_align!r}; choose from malloc, page")
    sizes = [int(x) for x in args.engine_blocks.split(",") if x]
    if not sizes or min(sizes) < BATCH:
        p.error(f"--engine-blocks: {args.engine_blocks!r}; each at least {BATCH}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: {args.modes!r}; choose from {', '.join(MODES)}")
    if args.bursts < 1:
        p.error(f"--bursts: {args.bursts}; need at least 1")
    if not 1 <= args.layers <= 256:
        p.error(f"--layers: {args.layers}; need 1..256")
    pool = "128mb" if args.quick else "1gb"
    pool_blocks = ((128 if args.quick else 1024) << 20) // (args.layers * PAGE)
    blocks = 3 * pool_blocks // BATCH * BATCH  # 3x the pool: L1 evicts
    reps = args.reps or (1 if args.quick else 3)
    name = "ssd_writebehind" + ("_quick" if args.quick else "")
    results: dict[str, object] = {"command": " ".join(sys.argv), "rows": []}
    rows = results["rows"]
    assert isinstance(rows, list)
    combos = [
        (m, sw, al, eb)
        for eb in sizes
        for al in aligns
        for m in modes
        for sw in switches
    ]
    for rep in range(reps):  # modes interleaved: drift hits all alike
        for mode, sw, al, eb in combos:
            trace = None
            if args.trace_dir:
                Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                sw_tag = "" if sw is None else f"_sw{sw:g}"
                trace = f"{args.trace_dir}/trace_{mode}_{al}_{eb}{sw_tag}_{rep}.json"
            row = run_mode(
                mode,
                pool,
                blocks,
                Path(args.dir),
                sw,
                al,
                trace,
                eb,
                args.layers,
                args.bursts,
                tuple(args.tier_arg),
            )
            rows.append({"rep": rep, "switch_ms": sw, **row})
            write_json(name, results, args.json)
            print(rows[-1], flush=True)
    cols = ["rep", "mode", "block_KiB", "engine_align", "engine_MiB", "switch_ms"]
    cols += ["GiB_saved"]
    cols += ["stored"]
    cols += ["save_GBps", "first_GBps"]
    cols += ["evictions"]
    cols += ["ssd_written_GiB", "ssd_write_GBps", "dropped", "refused_held"]
    print(table(rows, cols))

    def cell(mode: str, sw: float | None, al: str, eb: int) -> list[float]:
        key = (mode, sw, al, eb * args.layers * PAGE >> 20)
        fields = ("mode", "switch_ms", "engine_align", "engine_MiB")
        return [r["save_GBps"] for r in rows if tuple(r[f] for f in fields) == key]

    for mode, sw, al, eb in combos:
        label = f"{mode}, {al}, {eb} engine blocks"
        label += "" if sw is None else f" (switch {sw:g} ms)"
        got = cell(mode, sw, al, eb)
        line = f"{label}: median save {np.median(got):.3f} GB/s"
        base = cell("none", sw, al, eb)
        if mode != "none" and len(base) == len(got):  # each round's own pair
            losses = [1 - g / b for g, b in zip(got, base, strict=True)]
            line += f", loss against none: median {np.median(losses):.1%}"
            line += " (rounds: " + ", ".join(f"{x:.1%}" for x in losses) + ")"
        print(line)
    print(f"wrote {write_json(name, results, args.json)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
