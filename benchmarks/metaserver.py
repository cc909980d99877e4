"""pegaflow-metaserver numbers (issue 11): hashes/s inserted, 1,000-hash
prefix query latency, and RSS per million entries, over real gRPC from one
client to a metaserver subprocess.

    python benchmarks/metaserver.py                    # 2M entries
    python benchmarks/metaserver.py --entries 500000   # a quick run

Goals: >= 200k hashes/s inserted, 1,000-hash prefix query P50 <= 1 ms. Hashes
are random 32-byte values (vLLM's sha256 block hashes); requests are built
before the clock starts, so the time is the metaserver's plus gRPC's (the
empty-call and in-process columns say how it splits). Inserts alternate
between two nodes batch by batch, so a prefix across batches has several
segments, as a real cluster's would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from pegaflow.metaserver.index import BlockIndex  # noqa: E402
from pegaflow.metaserver.meta_client import MetaClient  # noqa: E402
from pegaflow.metaserver.meta_service import blocks  # noqa: E402
from pegaflow.proto import metaserver_pb2 as pb  # noqa: E402

NS = b"\x11" * 32
HASH = 32


def start(max_entries: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pegaflow.metaserver",
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--log-level",
            "warning",
            "--max-entries",
            str(max_entries),
        ],
        stdout=subprocess.PIPE,
    )
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"metaserver did not start: {line!r}")
    return proc, line.split()[1].split("=", 1)[1]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def insert_rate(
    nodes: list[MetaClient], total: int, batch: int
) -> tuple[float, list[bytes]]:
    """Insert `total` fresh hashes in `batch`-hash requests, owners taking
    turns; hashes/s and the hashes in order."""
    data = os.urandom(total * HASH)
    requests = []
    for at in range(0, total, batch):
        n = min(batch, total - at)
        owner = nodes[(at // batch) % len(nodes)]
        blocks = pb.Blocks(
            namespace=NS, hash_len=HASH, hashes=data[at * HASH : (at + n) * HASH]
        )
        requests.append((owner, pb.InsertRequest(node=owner.node, blocks=blocks)))
    start_s = time.perf_counter()
    for owner, request in requests:
        owner.call("Insert", request)
    seconds = time.perf_counter() - start_s
    hashes = [data[i * HASH : (i + 1) * HASH] for i in range(0, total)]
    return total / seconds, hashes


def query_latency(
    asker: MetaClient, prefix: list[bytes], reps: int
) -> tuple[float, float, int]:
    request = pb.QueryPrefixRequest(
        blocks=pb.Blocks(namespace=NS, hash_len=HASH, hashes=b"".join(prefix)),
        asker_node_id=asker.node.node_id,
    )
    times, segments = [], 0
    for _ in range(reps):
        start_s = time.perf_counter()
        got = asker.call("QueryPrefix", request)
        times.append(time.perf_counter() - start_s)
        segments = len(got.segments)
        assert got.matched == len(prefix), got.matched
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))], segments


def spread_latency(
    asker: MetaClient, held: list[bytes], n: int, reps: int
) -> tuple[float, float]:
    """P50 and P99 of n-hash queries, each over another window of `held`:
    a cluster asks for many prefixes, so the index entries a query touches
    are rarely in the CPU caches (repeating one prefix measures them hot)."""
    starts = np.random.default_rng(7).integers(0, len(held) - n, reps)
    requests = [
        pb.QueryPrefixRequest(
            blocks=pb.Blocks(
                namespace=NS, hash_len=HASH, hashes=b"".join(held[s : s + n])
            ),
            asker_node_id=asker.node.node_id,
        )
        for s in starts.tolist()
    ]
    times = []
    for request in requests:
        start_s = time.perf_counter()
        got = asker.call("QueryPrefix", request)
        times.append(time.perf_counter() - start_s)
        assert got.matched == n, got.matched
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def in_process(
    held: list[bytes], prefix: list[bytes], step: int, reps: int = 500
) -> float:
    """P50 of the servicer's own work for one query (unpack + plan) on an
    index in this process holding `held`, owners taking turns every `step`."""
    index = BlockIndex(len(held) + 1)
    for at in range(0, len(held), step):
        index.insert(NS, held[at : at + step], (at // step) % 2, float(at))
    request = pb.QueryPrefixRequest(
        blocks=pb.Blocks(namespace=NS, hash_len=HASH, hashes=b"".join(prefix))
    )
    times = []
    for _ in range(reps):
        start_s = time.perf_counter()
        digest, hashes = blocks(request.blocks)
        index.prefix(digest, hashes, 2)
        times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def heartbeat_latency(node: MetaClient, reps: int) -> float:
    times = []
    for _ in range(reps):
        start_s = time.perf_counter()
        node.heartbeat()
        times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=2_000_000)
    parser.add_argument("--batches", default="1024,16384")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    proc, addr = start(args.entries * (len(batches) + 1))
    try:
        nodes = [MetaClient(addr, f"node-{i}", 1, timeout_s=60) for i in range(2)]
        asker = MetaClient(addr, "asker", 1, timeout_s=60)
        for i, node in enumerate([*nodes, asker]):
            node.join(f"10.0.0.{i + 1}:17000")
        base = rss(proc.pid)
        rows, prefix = [], []
        for batch in batches:
            rate, held = insert_rate(nodes, args.entries, batch)
            prefix = prefix or held
            rows.append({"batch": batch, "hashes/s": round(rate)})
        entries = args.entries * len(batches)
        per_million = (rss(proc.pid) - base) / (entries / 1e6)
        empty_p50 = heartbeat_latency(asker, args.reps)
        # 200 hashes from each of 5 batches: a 1,000-hash prefix of 5 segments.
        step = batches[0]
        mixed = [h for s in range(5) for h in prefix[s * step : s * step + 200]]
        queries = []
        for sub in (prefix[:1000], mixed, prefix[:100]):
            p50, p99, segments = query_latency(asker, sub, args.reps)
            queries.append(
                {
                    "hashes": len(sub),
                    "segments": segments,
                    "p50_ms": round(p50 * 1e3, 3),
                    "p99_ms": round(p99 * 1e3, 3),
                    "in_process_p50_ms": round(
                        in_process(prefix[: 8 * step], sub, step) * 1e3, 3
                    ),
                }
            )
        spread_p50, spread_p99 = spread_latency(asker, prefix, 1000, args.reps)
    finally:
        proc.terminate()
        proc.wait(10)
    print(table(rows, ["batch", "hashes/s"]))
    print()
    print(table(queries, [*queries[0]]))
    print()
    print(
        f"1,000-hash queries over spread prefixes (cold index entries): P50 "
        f"{spread_p50 * 1e3:.3f} ms, P99 {spread_p99 * 1e3:.3f} ms"
    )
    print(f"empty call (Heartbeat) P50: {empty_p50 * 1e3:.3f} ms")
    print(
        f"RSS: {per_million / 2**20:.0f} MiB per million entries "
        f"({entries} entries, 32-byte hashes)"
    )
    path = write_json(
        "metaserver",
        {
            "entries": entries,
            "insert": rows,
            "query": queries,
            "query_spread_1000": {
                "p50_ms": round(spread_p50 * 1e3, 3),
                "p99_ms": round(spread_p99 * 1e3, 3),
            },
            "heartbeat_p50_ms": round(empty_p50 * 1e3, 3),
            "rss_mib_per_million_entries": round(per_million / 2**20, 1),
            "goals": {"insert_hashes_per_s": 200_000, "query_1000_p50_ms": 1.0},
        },
        args.json,
    )
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
