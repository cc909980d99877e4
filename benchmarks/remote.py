"""Remote tier throughput and latency over a veth pair, next to a raw socket.

Two nodes, each in its own network namespace (tests/remote/netns.py: a bridge,
a veth pair per node), with a metaserver in a third. For each prefix size an
engine on node 1 saves a fresh prefix (Llama-3.1-8B blocks: 32 layers x 64 KiB
= 2 MiB), and an engine on node 2 asks for it: a local miss, the metaserver's
plan, one pin + one one-sided read (Mooncake TCP) + checksums, published, then
ready. Measured per size (median of --repeat):
  fetch      node 2's own time, query to the last block checked and published
  ready      the engine's time from its first query to the ready answer (its
             polls every 1 ms included)
  mooncake   one Mooncake batch read of the same bytes between the same two
             namespaces, no server, no checksums: the transport alone
  raw        the same bytes over one TCP connection between the same two
             namespaces (sendall / recv_into, no checksums): the ceiling
and the ratio fetch / raw. Also the advertising cost: a save's time on node 1
with the remote tier on against a server without it (same pool, same blocks).

    sudo python benchmarks/remote.py             # root: makes the namespaces
    python benchmarks/remote.py --sizes-mib 2,64 --repeat 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, table, write_json
from tests.metaserver.conftest import start_metaserver
from tests.procs import EngineProc, start_server
from tests.remote.netns import Netns

LAYERS, PAGE = 32, 64 << 10
BLOCK_BYTES = LAYERS * PAGE
SHAPE = dict(layout="LBNHC", layers=LAYERS, heads=8, block_size=16, head=128)
_RAW = """
import socket, sys, time
n, port, role, host = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
buf = bytearray(64 << 20)
if role == "recv":
    srv = socket.create_server((host, port))  # port 0: the kernel picks a free one
    print("up", srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); got = 0; view = memoryview(buf)
    start = time.perf_counter()
    while got < n:
        k = conn.recv_into(view[: min(len(buf), n - got)])
        if not k: break
        got += k
    print(got, time.perf_counter() - start, flush=True)
else:
    conn = socket.create_connection((host, port)); left = n; view = memoryview(buf)
    while left:
        k = min(len(buf), left); conn.sendall(view[:k]); left -= k
    conn.close()
"""


_TE = """
import sys, time, numpy as np
from pegaflow.tiers.remote.transfer_engine import MooncakeTransport, TransportSettings
n, role, host = int(sys.argv[1]), sys.argv[2], sys.argv[3]
te = MooncakeTransport(TransportSettings("tcp", host))
buf = np.ones(n, np.uint8); te.register(buf.ctypes.data, n)
if role == "owner":
    print(te.endpoint, buf.ctypes.data, flush=True); sys.stdin.readline()
else:
    endpoint, base = sys.argv[4], int(sys.argv[5]); blk = 2 << 20; k = n // blk
    rng = np.random.default_rng(0)
    local = buf.ctypes.data + np.arange(k, dtype=np.uint64) * blk
    remote = base + rng.permutation(k).astype(np.uint64) * blk
    lengths = np.full(k, blk, np.uint64)
    te.read(endpoint, local[:1], remote[:1], lengths[:1])  # connect
    start = time.perf_counter(); te.read(endpoint, local, remote, lengths)
    print(time.perf_counter() - start, flush=True)
"""


def _env() -> dict[str, str]:
    """This process's environment with the checkout first on the path: where
    Mooncake comes from a --target folder on PYTHONPATH (the H200 host), the
    helpers find it too."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def transport_alone(net: Netns, src: int, dst: int, nbytes: int) -> float:
    """Seconds for one Mooncake batch read of nbytes (2 MiB entries, random
    order) by dst from src, with no pegaflow server around it."""
    owner = subprocess.Popen(
        net.nodes[src].argv(sys.executable, "-c", _TE, str(nbytes), "owner",
                            net.nodes[src].address),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env(),
    )  # fmt: skip
    try:
        endpoint, base = owner.stdout.readline().split()
        out = subprocess.run(
            net.nodes[dst].argv(sys.executable, "-c", _TE, str(nbytes), "reader",
                                net.nodes[dst].address, endpoint.decode(),
                                base.decode()),
            capture_output=True, check=True, cwd=ROOT,
            env=_env(),
        )  # fmt: skip
        return float(out.stdout.split()[-1])
    finally:
        owner.communicate(b"\n", timeout=30)


def raw_transfer(net: Netns, src: int, dst: int, nbytes: int) -> float:
    """Seconds for nbytes over one TCP connection, src's namespace to dst's."""
    host = net.nodes[dst].address
    recv = subprocess.Popen(
        net.nodes[dst].argv(sys.executable, "-c", _RAW, str(nbytes), "0",
                            "recv", host),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    # A fixed port failed on the H200 (2026-12-02: "Address already in use"
    # at the 1 GiB row): each receiver takes a free one and says which.
    up, port = recv.stdout.readline().split()
    assert up == b"up", up
    subprocess.run(
        net.nodes[src].argv(sys.executable, "-c", _RAW, str(nbytes), port.decode(),
                            "send", host),
        check=True,
    )  # fmt: skip
    got, seconds = recv.stdout.readline().split()
    recv.wait(30)
    assert int(got) == nbytes, (got, nbytes)
    return float(seconds)


def stats(server) -> dict:
    return json.loads(server.get("/stats")[1])["tiers"]["remote"]


def wait_advertised(server, count: int, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while stats(server)["advertised"] < count:
        if time.monotonic() > end:
            raise RuntimeError(f"not advertised: {stats(server)}")
        time.sleep(0.01)


def advertise_cost(tmp: Path, node, meta_addr: str, env: dict, saves: int) -> dict:
    """Median time of a 16-block save on a fresh server of the remote tier
    (advertising every sealed block) against a fresh one without it, same
    namespace geometry, pools large enough that nothing is evicted, the two
    alternating so drift hits both alike."""
    blocks = 16
    pool = f"{(saves * blocks * BLOCK_BYTES * 5 // 4) >> 20}mb"
    procs: list = []
    engines = {}
    try:
        for side, port, extra in (
            ("on", 50058, ["--metaserver-addr", f"http://{meta_addr}"]),
            ("off", 50057, []),
        ):
            server = start_server(
                tmp, "--addr", f"{node.address}:{port}", "--http-addr",
                f"{node.address}:{port + 1000}", "--pool-size", pool, "--log-level",
                "warning", "--socket", str(tmp / f"cost-{side}.sock"), *extra,
                prefix=tuple(node.argv()), env=env, timeout=300,
            )  # fmt: skip
            procs.append(server)
            engine = EngineProc(prefix=tuple(node.argv()))
            procs.append(engine)
            engine.call("init", seed=9, blocks=blocks, **SHAPE, timeout=300)
            engine.call("register", addr=server.addr, instance=side, namespace="c")
            engines[side] = engine
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(saves):
            for side, engine in engines.items():
                hashes = [secrets.token_hex(32) for _ in range(blocks)]
                t = time.perf_counter()
                engine.call("save", block_ids=list(range(blocks)), hashes=hashes)
                times[side].append(time.perf_counter() - t)
    finally:
        for proc in reversed(procs):
            (proc.close if isinstance(proc, EngineProc) else proc.stop)()
    on, off = (statistics.median(times[k]) for k in ("on", "off"))
    return {"blocks": blocks, "saves": saves, "on_ms": round(on * 1e3, 2),
            "off_ms": round(off * 1e3, 2),
            "cost_pct": round((on / off - 1) * 100, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="2,4,16,64,256,1024")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--latency-blocks", type=int, default=640, help="10K tokens")
    p.add_argument("--cost-saves", type=int, default=40, help="saves per side")
    p.add_argument("--poll-ms", type=float, default=1.0,
                   help="the reader engine's poll while `loading`")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    # SIGTERM (a timeout, a Ctrl-C from a supervisor) still removes the namespaces
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    most = max(max(sizes) * (1 << 20) // BLOCK_BYTES, args.latency_blocks)
    # room for the largest prefix twice over (peers pin at most half a pool)
    pool = f"{(most * BLOCK_BYTES * 5 // 2) >> 20}mb"
    engine_blocks = most + 8
    tmp = Path(ROOT / "benchmarks" / "results" / ".remote-run")
    tmp.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    env = {"PEGAFLOW_PEER_TOKEN": token}
    net = Netns()
    procs: list = []
    rows: list[dict] = []
    try:
        meta_node, a, b = net.add_node(), net.add_node(), net.add_node()
        meta = start_metaserver(
            tmp, "--addr", f"{meta_node.address}:50056", "--http-addr",
            f"{meta_node.address}:9092", "--log-level", "warning",
            "--peer-token-env", "PEGAFLOW_PEER_TOKEN", env=env,
            prefix=tuple(meta_node.argv()),
        )  # fmt: skip
        procs.append(meta)
        servers = []
        for i, node in enumerate((a, b)):
            servers.append(
                start_server(
                    tmp,
                    "--addr",
                    f"{node.address}:50055",
                    "--http-addr",
                    f"{node.address}:9091",
                    "--pool-size",
                    pool,
                    "--log-level",
                    "warning",
                    "--metaserver-addr",
                    f"http://{meta_node.address}:50056",
                    "--socket",
                    str(tmp / f"n{i}.sock"),
                    prefix=tuple(node.argv()),
                    env=env,
                    timeout=300,
                )  # fmt: skip
            )
            procs.append(servers[-1])
        engines = []
        for i, node in enumerate((a, b)):
            e = EngineProc(prefix=tuple(node.argv()))
            procs.append(e)
            e.call("init", seed=i, blocks=engine_blocks, **SHAPE, timeout=300)
            e.call("register", addr=servers[i].addr, instance=f"e{i}", namespace="b")
            engines.append(e)
        owner, reader = engines
        # First, while both pools are empty: the same saves evict alike later.
        cost = advertise_cost(tmp, a, f"{meta_node.address}:50056", env,
                              args.cost_saves)  # fmt: skip
        print(f"advertising cost: {cost}", flush=True)

        def one(n: int) -> dict:
            advertised = stats(servers[0])["advertised"] + n
            hashes = [secrets.token_hex(32) for _ in range(n)]
            t = time.perf_counter()
            owner.call("save", block_ids=list(range(n)), hashes=hashes, timeout=300)
            save_s = time.perf_counter() - t
            wait_advertised(servers[0], advertised)
            got = reader.call("query", hashes=hashes, wait_s=120,
                              poll_s=args.poll_ms / 1e3, timeout=300)  # fmt: skip
            assert got["num_blocks"] == n, got
            reader.call("load", lease_id=got["lease_id"], block_ids=list(range(n)),
                        timeout=300)  # fmt: skip
            want = owner.call("digest", block_ids=list(range(n)), timeout=300)
            have = reader.call("digest", block_ids=list(range(n)), timeout=300)
            assert want == have, "bytes differ"
            st = stats(servers[1])
            print(f"  {n} blocks: phases {st['fetch_phases_ms_last']}", flush=True)
            return {"fetch_s": st["fetch_ms_last"] / 1e3,
                    "ready_s": got["seconds"], "save_s": save_s}  # fmt: skip

        one(1)  # warm: connections, the transfer engine's first read
        for mib in sizes:
            n = max(1, mib * (1 << 20) // BLOCK_BYTES)
            nbytes = n * BLOCK_BYTES
            runs, raws, alone = [], [], []
            for _ in range(args.repeat):  # interleaved: the VM's noise hits all
                runs.append(one(n))
                raws.append(raw_transfer(net, 1, 2, nbytes))
                alone.append(transport_alone(net, 1, 2, nbytes))
            fetch = statistics.median(r["fetch_s"] for r in runs)
            ready = statistics.median(r["ready_s"] for r in runs)
            raw = statistics.median(raws)
            te = statistics.median(alone)
            rows.append({
                "MiB": nbytes >> 20, "blocks": n,
                "fetch_ms": round(fetch * 1e3, 1), "ready_ms": round(ready * 1e3, 1),
                "fetch_GBps": round(nbytes / fetch / 1e9, 3),
                "mooncake_GBps": round(nbytes / te / 1e9, 3),
                "raw_GBps": round(nbytes / raw / 1e9, 3),
                "fetch/raw": round(raw / fetch, 2),
                "save_ms": round(statistics.median(r["save_s"] for r in runs) * 1e3, 1),
            })  # fmt: skip
            print(table(rows[-1:], list(rows[-1])), flush=True)
        lat = [one(args.latency_blocks) for _ in range(args.repeat)]
        latency = {
            "blocks": args.latency_blocks,
            "bytes": args.latency_blocks * BLOCK_BYTES,
            "fetch_ms": [round(r["fetch_s"] * 1e3, 1) for r in lat],
            "ready_ms": [round(r["ready_s"] * 1e3, 1) for r in lat],
        }
    finally:
        for proc in reversed(procs):
            (proc.close if isinstance(proc, EngineProc) else proc.stop)()
        net.close()
    print()
    print(table(rows, list(rows[0])))
    print(f"\nquery -> ready, {latency['blocks']} blocks "
          f"({latency['bytes'] >> 20} MiB): fetch {latency['fetch_ms']} ms, "
          f"engine ready {latency['ready_ms']} ms")  # fmt: skip
    print(f"save of {cost['blocks']} blocks: {cost['on_ms']} ms with the remote "
          f"tier, {cost['off_ms']} ms without ({cost['cost_pct']:+.1f} %)")  # fmt: skip
    out = write_json("remote", {"command": " ".join(sys.argv), "rows": rows,
                                "latency": latency, "advertise_cost": cost},
                     args.json)  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
