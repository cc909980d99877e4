"""`python -m pegaflow.demo --nodes 2`: the cross-node tier on one host.

A pegaflow-metaserver and two pegaflow-servers (two nodes on loopback ports,
TCP transport); engine A saves on node 1, engine B on node 2 misses locally,
gets the blocks from node 1 through the metaserver's plan, loads them and
checks every byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack


def _spawn(argv: list[str]) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{argv[2]} did not start: {line!r}")
    return proc, dict(part.split("=", 1) for part in line.split()[1:])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_nodes(stack: ExitStack, pool_size: int, nodes: int) -> list[dict[str, str]]:
    """A metaserver and `nodes` servers joined to it; their READY fields."""
    meta, meta_fields = _spawn(
        [sys.executable, "-m", "pegaflow.metaserver", "--addr", "127.0.0.1:0",
         "--http-addr", "127.0.0.1:0", "--log-level", "warning"]
    )  # fmt: skip
    stack.callback(_stop, meta)
    print(f"metaserver: {meta_fields['grpc']}", flush=True)
    servers = []
    for i in range(nodes):
        proc, fields = _spawn(
            [sys.executable, "-m", "pegaflow.cli", "--addr", "127.0.0.1:0",
             "--http-addr", "127.0.0.1:0", "--pool-size", str(pool_size),
             "--log-level", "warning", "--no-progress",
             "--metaserver-addr", f"http://{meta_fields['grpc']}",
             "--node-id", f"node-{i + 1}", "--remote-allow-loopback"]
        )  # fmt: skip
        stack.callback(_stop, proc)
        print(f"node {i + 1}: pegaflow-server {fields['grpc']}", flush=True)
        servers.append(fields)
    return servers


def remote_stats(http: str) -> dict:
    with urllib.request.urlopen(f"http://{http}/stats", timeout=5) as r:
        return json.load(r)["tiers"]["remote"]


def wait_advertised(http: str, blocks: int, timeout_s: float = 30.0) -> float:
    """Until the node has sent `blocks` hashes to the metaserver; seconds."""
    start = time.perf_counter()
    while remote_stats(http)["advertised"] < blocks:
        if time.perf_counter() - start > timeout_s:
            raise RuntimeError(f"node at {http} did not advertise {blocks} blocks")
        time.sleep(0.01)
    return time.perf_counter() - start
