"""Host copy path through a real server: Save/Load GB/s vs batch size, next to a
single-thread memcpy of the same bytes; QueryPrefix latency; pool bring-up.

    python benchmarks/host_path.py                  # full run (~4 GiB of RAM)
    python benchmarks/host_path.py --quick          # small, for a smoke check
    python benchmarks/host_path.py --round-trips 2000 --busy-poll-us 500
                                                    # 1-block latency, busy polling
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import start_server, table, write_json  # noqa: E402
from pegaflow.cache.pool import HostPool  # noqa: E402
from pegaflow.client.kv_layouts import describe, vllm_layer_views  # noqa: E402
from pegaflow.client.pegaflow_client import PegaflowClient  # noqa: E402
from pegaflow.common.settings import PoolConfig  # noqa: E402

PAGE = 64 << 10  # Llama-3.1-8B: 8 KV heads x 16 tokens x 2 x 128 x bf16


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def bench_copies(addr: str, layers: int, sizes: list[int], reps: int) -> list[dict]:
    blocks = max(sizes) * 2
    buf = np.empty(layers * blocks * PAGE, np.uint8)
    buf[:] = np.frombuffer(np.random.default_rng(0).bytes(buf.nbytes), np.uint8)
    views = vllm_layer_views(buf, layers, blocks, (PAGE,))
    mem = describe(views)
    rows = []
    rng = np.random.default_rng(1)
    with PegaflowClient(addr, timeout_s=120) as client:
        client.register_host(
            "bench", "bench-llama", os.getpid(), mem.regions, mem.layers
        )
        for n in sizes:
            nbytes = n * layers * PAGE
            save_s, load_s = [], []
            for _ in range(reps):
                src = rng.choice(blocks, n, replace=False)
                hashes = [secrets.token_bytes(32) for _ in range(n)]
                t = time.perf_counter()
                res = client.save("bench", src, hashes)
                save_s.append(time.perf_counter() - t)
                assert res.stored == n, res
                hit = client.query("bench", hashes)
                others = np.setdiff1d(np.arange(blocks), src)
                dst = rng.choice(others, n, replace=False)
                t = time.perf_counter()
                client.load("bench", hit.lease_id, dst)
                load_s.append(time.perf_counter() - t)
                for layer in (0, layers - 1):  # spot-check bytes every rep
                    assert np.array_equal(views[layer][dst], views[layer][src])
            ref = memcpy_gbps(nbytes, 5)
            save = nbytes / np.median(save_s) / 1e9
            load = nbytes / np.median(load_s) / 1e9
            rows.append(
                {
                    "blocks": n,
                    "MiB": nbytes >> 20,
                    "save_GBps": round(save, 2),
                    "load_GBps": round(load, 2),
                    "memcpy_GBps": round(ref, 2),
                    "save/memcpy": round(save / ref, 2),
                    "load/memcpy": round(load / ref, 2),
                    "save_p50_ms": round(np.median(save_s) * 1e3, 3),
                    "load_p50_ms": round(np.median(load_s) * 1e3, 3),
                }
            )
            print(f"  {n} blocks done", file=sys.stderr)
    return rows


def bench_round_trips(addr: str, layers: int, reps: int, busy_us: int) -> list[dict]:
    """1-block save, query and load P50 (ms) at the client, with replies slept
    on and busy-polled for busy_us (PegaflowClient(busy_poll_us=...)): two
    clients, one instance each over the same memory, taking turns."""
    blocks = 64
    buf = np.empty(layers * blocks * PAGE, np.uint8)
    buf[:] = np.frombuffer(np.random.default_rng(2).bytes(buf.nbytes), np.uint8)
    views = vllm_layer_views(buf, layers, blocks, (PAGE,))
    mem = describe(views)
    clients = {
        us: PegaflowClient(addr, timeout_s=60, busy_poll_us=us) for us in (0, busy_us)
    }
    times: dict[int, dict[str, list[float]]] = {
        us: {"save": [], "query": [], "load": []} for us in clients
    }
    try:
        for us, client in clients.items():
            client.register_host(
                f"rt{us}", "bench-rt", os.getpid(), mem.regions, mem.layers
            )
        for rep in range(reps + 20):  # 20 untimed turns first
            for us, client in clients.items():
                name, hashes = f"rt{us}", [secrets.token_bytes(32)]
                t0 = time.perf_counter()
                client.save(name, np.array([rep % 32]), hashes)
                t1 = time.perf_counter()
                hit = client.query(name, hashes)
                t2 = time.perf_counter()
                client.load(name, hit.lease_id, np.array([32 + rep % 32]))
                t3 = time.perf_counter()
                if rep >= 20:
                    for kind, took in zip(
                        times[us], (t1 - t0, t2 - t1, t3 - t2), strict=True
                    ):
                        times[us][kind].append(took)
        for layer in (0, layers - 1):  # the last turn's bytes
            assert np.array_equal(views[layer][32 + (rep % 32)], views[layer][rep % 32])
    finally:
        for client in clients.values():
            client.close()
    return [
        {"busy_poll_us": us, "reps": reps}
        | {
            f"{kind}_p50_ms": round(float(np.median(t)) * 1e3, 3)
            for kind, t in got.items()
        }
        for us, got in times.items()
    ]


def _latency_ms(fn: object, reps: int) -> tuple[float, float]:
    lat = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    ms = np.array(lat) * 1e3
    return round(float(np.percentile(ms, 50)), 3), round(
        float(np.percentile(ms, 99)), 3
    )


def bench_queries(
    addr: str, sizes: list[int], reps: int, resident: int = 0
) -> list[dict]:
    """Client-side QueryPrefix latency over the unix socket and over gRPC, beside
    the floor: an empty gRPC call (Health) on the same channel. resident > 0:
    then again over the socket with that many other blocks resident (a big
    index: its lookups miss the CPU caches)."""
    page = 512  # the smallest page a registration may have (common.request_limits)
    blocks = max(sizes)
    buf = np.zeros(blocks * page, np.uint8)
    mem = describe(vllm_layer_views(buf, 1, blocks, (page,)))
    rows = []
    with PegaflowClient(addr, timeout_s=30) as fast, PegaflowClient(addr) as slow:
        fast.register_host("q", "bench-query", os.getpid(), mem.regions, mem.layers)
        slow.disable_socket()  # this client always takes gRPC
        hashes = [secrets.token_bytes(32) for _ in range(blocks)]
        fast.save("q", np.arange(blocks), hashes)
        p50, p99 = _latency_ms(slow.health, reps)
        rows.append(
            {
                "path": "gRPC empty call (floor)",
                "hashes": 0,
                "p50_ms": p50,
                "p99_ms": p99,
            }
        )
        runs = [("unix socket", fast, sizes), ("gRPC", slow, sizes)]
        if resident:
            runs.append((f"unix socket, {resident} resident", fast, sizes[-1:]))
        for path, client, run_sizes in runs:
            if client is fast and "resident" in path:
                _fill(fast, blocks, resident)
            for n in run_sizes:
                # time the query alone: release outside the timed call
                lat = []
                for _ in range(reps):
                    t = time.perf_counter()
                    # as the connector asks: vLLM's hashes have one length
                    hit = client.query("q", hashes[:n], hash_len=32)
                    lat.append(time.perf_counter() - t)
                    assert hit.num_blocks == n
                    slow.release_lease(hit.lease_id)
                ms = np.array(lat) * 1e3
                rows.append(
                    {
                        "path": path,
                        "hashes": n,
                        "p50_ms": round(float(np.percentile(ms, 50)), 3),
                        "p99_ms": round(float(np.percentile(ms, 99)), 3),
                    }
                )
    return rows


def _fill(client: PegaflowClient, blocks: int, total: int) -> None:
    """Save `total` more blocks (fresh hashes, the bytes are irrelevant)."""
    for done in tqdm(range(0, total, blocks), desc="resident blocks", unit="save"):
        n = min(blocks, total - done)
        client.save("q", np.arange(n), [secrets.token_bytes(32) for _ in range(n)])


def bench_bring_up(size: int) -> dict:
    pool = HostPool(PoolConfig(size_bytes=size, show_progress=False))
    up = pool.bring_up
    pool.close()
    return {
        "GiB": size >> 30,
        "seconds": round(up.seconds, 3),
        "GBps": round(up.gb_per_s, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--json", help="output path (default benchmarks/results/host_path.json)"
    )
    p.add_argument("--copy-threads", default="2")
    p.add_argument("--queries-only", action="store_true", help="skip copies, bring-up")
    p.add_argument(
        "--resident",
        type=int,
        default=0,
        help="also time the largest query with this many other blocks resident",
    )
    p.add_argument(
        "--round-trips",
        type=int,
        default=0,
        metavar="N",
        help="only N 1-block save/query/load round trips, replies slept on and "
        "busy-polled (--busy-poll-us) taking turns",
    )
    p.add_argument("--busy-poll-us", type=int, default=500)
    args = p.parse_args()
    if args.round_trips and args.busy_poll_us <= 0:
        p.error("--busy-poll-us: need > 0 to compare with sleeping on replies")
    layers = 4 if args.quick else 32
    sizes = [1, 16, 64] if args.quick else [1, 4, 16, 64, 256, 1024]
    qsizes = [64, 640] if args.quick else [64, 640, 2560]
    reps = 3 if args.quick else 7
    pool = "256mb" if args.quick else "6gb"
    proc, addr = start_server(
        "--pool-size", pool, "--copy-threads", args.copy_threads, "--no-progress"
    )
    if args.round_trips:
        try:
            rows = bench_round_trips(addr, layers, args.round_trips, args.busy_poll_us)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        payload = {"command": " ".join(sys.argv), "layers": layers, "round_trips": rows}
        out = write_json("host_path_round_trips", payload, args.json)
        print(table(rows, list(rows[0])))
        print(f"JSON: {out}")
        return 0
    try:
        copies = [] if args.queries_only else bench_copies(addr, layers, sizes, reps)
        queries = bench_queries(addr, qsizes, 50 if args.quick else 300, args.resident)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    bring_up = bench_bring_up((1 if args.quick else 8) << 30)
    out = write_json(
        "host_path",
        {
            "command": " ".join(sys.argv),
            "layers": layers,
            "page_bytes": PAGE,
            "copy_threads": int(args.copy_threads),
            "copies": copies,
            "queries": queries,
            "bring_up": bring_up,
        },
        args.json,
    )
    print(f"\nSave/Load through the server ({layers} layers x 64 KiB pages per block)")
    if copies:
        print(table(copies, list(copies[0])))
    print("\nQueryPrefix latency at the client (all hits)")
    print(table(queries, list(queries[0])))
    print(f"\nPool bring-up: {bring_up}")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
