"""The server's own time around a copy, on the host path (issue 12): a host
engine over the unix socket saves and loads N blocks x 32 layers of small
pages, so the copy is cheap and what is left is the server path (frame
decode, validation, slot reservation, descriptor table, completion,
publication, reply) that the GPU path runs too.

    python benchmarks/server_overhead.py [--sizes 1,64,640] [--reps 200]
        [--page 512] [--profile FILE.prof | --trace FILE.json] [--gap-ms 0,10]
        [--json FILE]

Per N: client-side P50 of save and load, and from the server's /metrics the
mean RPC time and the mean copy time (pegaflow_transfer_seconds) of the same
calls; `rpc - copy` is the server's bookkeeping. Every load is byte-checked
on its first rep. --profile runs the server under cProfile (written when it
stops).
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import phase_trace  # noqa: E402
from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.transfer import server_sums  # noqa: E402
from pegaflow.client.kv_layouts import describe, vllm_layer_views  # noqa: E402
from pegaflow.client.pegaflow_client import PegaflowClient  # noqa: E402

LAYERS = 32


def start(
    pool: str, profile: str | None, trace: str | None = None
) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        http = f"127.0.0.1:{sock.getsockname()[1]}"
    pre = phase_trace.python_args(profile, trace)
    cmd = [sys.executable, *pre, "-m", "pegaflow.cli", "--addr", "127.0.0.1:0"]
    cmd += ["--pool-size", pool, "--http-addr", http, "--log-level", "warning"]
    cmd += ["--no-progress", "--devices", "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split()[1].split("=", 1)[1], http


def bench(
    addr: str, http: str, sizes: list[int], reps: int, page: int,
    gap_s: float = 0.0, spin: bool = False,
) -> list:  # fmt: skip
    """gap_s: time before each timed save and load (an engine asks once a
    decode step, not back to back; benchmarks/idle_gap.py), asleep or, with
    `spin`, busy (as an engine's thread is, in its CUDA work)."""
    pause = functools.partial(_spin if spin else time.sleep, gap_s)
    blocks = 2 * max(sizes) + 2
    buf = np.frombuffer(
        np.random.default_rng(0).bytes(LAYERS * blocks * page), np.uint8
    ).copy()
    views = vllm_layer_views(buf, LAYERS, blocks, (page,))
    mem = describe(views)
    rng = np.random.default_rng(1)
    rows = []
    with PegaflowClient(addr, timeout_s=60) as client:
        client.register_host("ovh", "ovh-ns", os.getpid(), mem.regions, mem.layers)
        for n in sizes:
            saves, loads = [], []
            r = max(5, reps if n < 64 else reps * 64 // n)
            before = server_sums(http)
            for i in range(r):
                perm = rng.permutation(blocks)
                src, dst = perm[:n], perm[n : 2 * n]
                hashes = [secrets.token_bytes(32) for _ in range(n)]
                pause()
                t = time.perf_counter()
                res = client.save("ovh", src, hashes)
                saves.append(time.perf_counter() - t)
                assert res.stored == n, res
                hit = client.query("ovh", hashes)
                pause()
                t = time.perf_counter()
                got = client.load("ovh", hit.lease_id, dst)
                loads.append(time.perf_counter() - t)
                assert got.loaded == n, got
                if i == 0:
                    for layer in (0, LAYERS - 1):
                        assert np.array_equal(views[layer][dst], views[layer][src])
            srv = {k: 1e6 * v / r for k, v in _delta(before, server_sums(http)).items()}
            rows.append(
                dict(
                    N=n,
                    gap_ms=round(gap_s * 1e3, 1),
                    gap="spin" if spin else "sleep",
                    reps=r,
                    save_p50_us=round(1e6 * statistics.median(saves)),
                    save_rpc_us=round(srv["save_rpc"]),
                    save_copy_us=round(srv["save_copy"]),
                    save_other_us=round(srv["save_rpc"] - srv["save_copy"]),
                    load_p50_us=round(1e6 * statistics.median(loads)),
                    load_rpc_us=round(srv["load_rpc"]),
                    load_copy_us=round(srv["load_copy"]),
                    load_other_us=round(srv["load_rpc"] - srv["load_copy"]),
                )
            )
            print(rows[-1], flush=True)
        client.unregister("ovh")
    return rows


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,64,640")
    p.add_argument("--reps", type=int, default=200, help="at N < 64; fewer above")
    p.add_argument("--page", type=int, default=512, help="bytes per layer page")
    p.add_argument("--pool", default="1gb")
    p.add_argument("--profile", help="cProfile the server into this file")
    p.add_argument("--trace", help="phase_trace.py's JSON of the server, to this file")
    p.add_argument(
        "--gap-ms",
        default="0",
        help="idle time before each timed call, comma-separated: one pass each "
        "(an engine's step cadence instead of back to back)",
    )
    p.add_argument("--gap-spin", action="store_true", help="busy, not asleep, in gaps")
    p.add_argument("--json", help="output path (default: print only)")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    gaps = [float(x) * 1e-3 for x in args.gap_ms.split(",")]
    proc, addr, http = start(args.pool, args.profile, args.trace)
    try:
        rows = []
        for gap_s in gaps:
            rows += bench(addr, http, sizes, args.reps, args.page, gap_s, args.gap_spin)
    finally:
        proc.terminate()
        proc.wait(60)
    print(table(rows, list(rows[0])))
    if args.json:
        write_json("server_overhead", {"rows": rows, "page": args.page}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
