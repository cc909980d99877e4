"""Reliability under abuse: what a local user (or a busy host) can hold of a
real server, and what an engine still gets meanwhile.

    python benchmarks/reliability.py
    python benchmarks/reliability.py --probes http,namespaces --slow-http 900

Starts pegaflow-server (a 64 MiB pool) and runs each probe in turn, on a
fresh server each:

  baseline     nothing: the figures to compare with.
  tcp          --tcp idle TCP connections to the gRPC port, never speaking.
  watch        --watches gRPC health Watch streams (they never end).
  query-bytes  --queries concurrent QueryPrefix requests of 240,000 hashes
               (7.8 MiB, under the 8 MiB cap) for an instance that does not
               exist, sent again and again while measuring.
  namespaces   --namespaces engines each save one block in a namespace of
               their own, query it and leave: idle namespaces.
  http         --slow-http connections sending one byte of a never-ending
               request head every 2 s, reconnecting when dropped.

While each probe holds, it reports the server's RSS (VmRSS, MiB), an engine's
registration latency (a host engine registering over the unix socket, then
unregistering; median of --samples), /health latency and how many /health
probes answered 200; then the RSS once the probe let go. The namespaces probe
also reports /metrics size and scrape time.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from benchmarks.common import table, write_json  # noqa: E402
from pegaflow.client.kv_layouts import describe, vllm_layer_views  # noqa: E402
from pegaflow.client.pegaflow_client import PegaflowClient  # noqa: E402
from pegaflow.proto import pegaflow_pb2 as pb  # noqa: E402

PROBES = ("baseline", "tcp", "watch", "query-bytes", "namespaces", "http")
MiB = 1 << 20


class Server:
    """pegaflow-server on free loopback ports, HTTP on."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pegaflow.cli", "--addr", "127.0.0.1:0",
             "--http-addr", "127.0.0.1:0", "--log-level", "warning",
             "--no-progress", "--pool-size", "64mb", *args],
            stdout=subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        line = self.proc.stdout.readline().decode()
        if not line.startswith("READY"):
            self.proc.kill()
            raise SystemExit(f"reliability: the server did not start: {line!r}")
        fields = dict(part.split("=", 1) for part in line.split()[1:])
        self.addr, self.http = fields["grpc"], fields["http"]

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://{self.http}{path}", timeout=timeout) as r:
            return r.status, r.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Engine:
    """A host engine's KV (2 layers x 8 blocks x 4 KiB) in this process."""

    def __init__(self) -> None:
        self.buf = np.zeros(2 * 8 * 4096, np.uint8)
        self.mem = describe(vllm_layer_views(self.buf, 2, 8, (4096,), False))

    def register(self, client: PegaflowClient, name: str) -> None:
        client.register_host(name, name, os.getpid(), self.mem.regions, self.mem.layers)


def measure(server: Server, samples: int) -> dict[str, object]:
    """Registration and /health latency, and RSS, while a probe holds."""
    engine, regs, healths, ok = Engine(), [], [], 0
    for i in range(samples):
        name = f"probe-{i}"
        try:
            with PegaflowClient(server.addr, timeout_s=30) as client:
                start = time.perf_counter()
                engine.register(client, name)
                regs.append((time.perf_counter() - start) * 1e3)
                client.unregister(name)
        except Exception as exc:  # a refused engine is a result, not a crash
            regs.append(float("nan"))
            print(f"  registration failed: {exc}", file=sys.stderr)
        start = time.perf_counter()
        with suppress(OSError):
            ok += server.get("/health")[0] == 200
        healths.append((time.perf_counter() - start) * 1e3)
    return {
        "rss_mib": round(server.rss_mib()),
        "register_ms": _median(regs),
        "health_ms": _median(healths),
        "health_ok": f"{ok}/{samples}",
    }


def _median(values: list[float]) -> float:
    good = [v for v in values if v == v]
    return round(statistics.median(good), 1) if good else float("nan")


# -- probes: each a context manager holding its load -------------------------
@contextmanager
def idle_tcp(server: Server, n: int) -> Iterator[str]:
    host, port = server.addr.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), 5) for _ in range(n)]
    try:
        yield f"{n} idle TCP connections"
    finally:
        for s in socks:
            s.close()


@contextmanager
def watches(server: Server, n: int) -> Iterator[str]:
    channels = [grpc.insecure_channel(server.addr) for _ in range(-(-n // 90))]
    calls = []
    for i in range(n):
        stub = health_pb2_grpc.HealthStub(channels[i % len(channels)])
        calls.append(stub.Watch(health_pb2.HealthCheckRequest(service="")))
    refused = 0
    for call in calls:  # the first answer of each: SERVING, or a refusal
        try:
            next(call)
        except grpc.RpcError:
            refused += 1
    try:
        yield f"{n} Watch streams ({refused} refused)"
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()


@contextmanager
def query_bytes(server: Server, n: int) -> Iterator[str]:
    body = pb.QueryPrefixRequest(
        instance_id="nobody",
        block_hashes=[os.urandom(32) for _ in range(240_000)],
    ).SerializeToString()
    stop, peak, sent = threading.Event(), [server.rss_mib()], [0]
    channel = grpc.insecure_channel(
        server.addr, options=[("grpc.max_send_message_length", 16 * MiB)]
    )
    call = channel.unary_unary(
        "/pegaflow.v1.PegaFlow/QueryPrefix", request_serializer=None
    )

    def burst() -> None:
        while not stop.is_set():
            futures = [call.future(body, timeout=120) for _ in range(n)]
            for f in futures:
                f.exception()
                sent[0] += 1
                peak[0] = max(peak[0], server.rss_mib())

    thread = threading.Thread(target=burst, daemon=True)
    thread.start()
    try:
        yield f"{n} concurrent 7.8 MiB QueryPrefix, repeated"
    finally:
        stop.set()
        thread.join(300)
        channel.close()
        print(f"  query-bytes: {sent[0]} sent, RSS peak {peak[0]:.0f} MiB")


@contextmanager
def namespaces(server: Server, n: int) -> Iterator[str]:
    engine = Engine()
    with PegaflowClient(server.addr, timeout_s=30) as client:
        for i in range(n):
            name = f"idle-{i}"
            engine.register(client, name)
            h = [os.urandom(32)]
            client.save(name, [0], h)
            client.release_lease(client.query(name, h).lease_id)
            client.unregister(name)
    start = time.perf_counter()
    size = len(server.get("/metrics", timeout=30)[1])
    scrape = (time.perf_counter() - start) * 1e3
    yield f"{n} idle namespaces; /metrics {size / 1024:.0f} KiB in {scrape:.0f} ms"


@contextmanager
def slow_http(server: Server, n: int) -> Iterator[str]:
    host, port = server.http.rsplit(":", 1)
    addr, stop, drops = (host, int(port)), threading.Event(), [0]

    def connect() -> socket.socket:
        s = socket.create_connection(addr, 5)
        s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        return s

    socks = [connect() for _ in range(n)]

    def trickle() -> None:
        while not stop.wait(2.0):
            for i, s in enumerate(socks):
                try:
                    s.sendall(b"a")
                except OSError:
                    drops[0] += 1
                    s.close()
                    with suppress(OSError):
                        socks[i] = connect()

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        yield f"{n} slow HTTP clients (a byte every 2 s)"
    finally:
        stop.set()
        thread.join(60)
        for s in socks:
            s.close()
        print(f"  http: the server dropped {drops[0]} trickling connections")


def run_probe(
    name: str, hold: Callable[[Server], object], samples: int, settle_s: float
) -> dict[str, object]:
    server = Server()
    try:
        before = measure(server, samples)
        with ExitStack() as stack:
            what = stack.enter_context(hold(server))
            time.sleep(settle_s)
            under = measure(server, samples)
        time.sleep(settle_s)
        after = round(server.rss_mib())
    finally:
        server.stop()
    return {
        "probe": name,
        "what": what,
        "rss_before_mib": before["rss_mib"],
        "rss_under_mib": under["rss_mib"],
        "rss_after_mib": after,
        "register_ms": under["register_ms"],
        "register_ms_idle": before["register_ms"],
        "health_ms": under["health_ms"],
        "health_ok": under["health_ok"],
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--probes", default=",".join(PROBES), help="comma-separated")
    p.add_argument("--tcp", type=int, default=1100)
    p.add_argument("--watches", type=int, default=1030)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--namespaces", type=int, default=400)
    p.add_argument("--slow-http", type=int, default=900)
    p.add_argument("--samples", type=int, default=5, help="per measurement")
    p.add_argument("--settle", type=float, default=3.0, help="seconds")
    p.add_argument("--json", default=None, help="results file")
    args = p.parse_args()
    holds: dict[str, Callable[[Server], object]] = {
        "baseline": lambda s: _nothing(),
        "tcp": lambda s: idle_tcp(s, args.tcp),
        "watch": lambda s: watches(s, args.watches),
        "query-bytes": lambda s: query_bytes(s, args.queries),
        "namespaces": lambda s: namespaces(s, args.namespaces),
        "http": lambda s: slow_http(s, args.slow_http),
    }
    chosen = [name.strip() for name in args.probes.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(PROBES))
    if unknown:
        p.error(f"--probes: unknown {', '.join(unknown)}; choose from {PROBES}")
    rows = []
    for name in chosen:
        print(f"probe {name} ...", flush=True)
        rows.append(run_probe(name, holds[name], args.samples, args.settle))
        print(f"  {rows[-1]}", flush=True)
    cols = ["probe", "rss_before_mib", "rss_under_mib", "rss_after_mib",
            "register_ms_idle", "register_ms", "health_ms", "health_ok"]  # fmt: skip
    print(table(rows, cols))
    for row in rows:
        print(f"{row['probe']}: {row['what']}")
    out = write_json("reliability", {"args": vars(args), "rows": rows}, args.json)
    print(f"results: {out}")
    return 0


@contextmanager
def _nothing() -> Iterator[str]:
    yield "nothing"


if __name__ == "__main__":
    sys.exit(main())
