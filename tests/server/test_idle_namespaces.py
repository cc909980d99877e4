"""Idle namespaces against a real server: what each costs while it waits for
its engine is bounded (issue 30 #5).

A namespace whose engine left but whose blocks stay is idle. Its hit-rate
state (HLL windows: ~0.4 MiB once queried, ~3 MiB after a day) and its 22
/metrics series stayed for up to 4,096 idle namespaces: ~785 KiB of RSS and
1.7 KB of /metrics each, so 400 of them made /metrics 715 KB. Now the 16 idle
the shortest keep it (--max-idle-namespaces), and each other idle namespace
costs its registry entry and block index.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes
from tests.procs import HOST_ONLY, ServerProc, start_server

IDLE = 300
KiB, MiB = 1 << 10, 1 << 20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path, "--pool-size", "64mb", *HOST_ONLY)
    yield srv
    srv.stop()


def _leave_idle(client: PegaflowClient, kv: LocalKV, name: str) -> None:
    """An engine saves one block in a namespace of its own, queries it (hit-rate
    state) and leaves: the namespace stays, idle, holding its block."""
    kv.register(client, name, name)
    hs = hashes(1)
    assert client.save(name, [0], hs).stored == 1
    client.release_lease(client.query(name, hs).lease_id)
    client.unregister(name)


@pytest.mark.timeout(300)
def test_idle_namespaces_cost_little_memory_and_metrics(server: ServerProc) -> None:
    """Regression: 300 namespaces left idle, one block each. All 300 stay (their
    blocks do), 16 keep hit-rate state; RSS grows < 100 MiB (was ~230) and
    /metrics < 150 KB (was ~510 KB)."""
    kv = LocalKV(layers=2, blocks=8)
    with PegaflowClient(server.addr, timeout_s=30) as client:
        for i in range(4):  # every code path seen once before the baseline
            _leave_idle(client, kv, f"warm-{i}")
        server.get("/stats")
        rss0 = _rss(server.pid)
        metrics0 = len(server.get("/metrics")[1])
        for i in range(IDLE):
            _leave_idle(client, kv, f"idle-{i}")
        stats = json.loads(server.get("/stats")[1])  # replays the hit-rate log
        metrics = len(server.get("/metrics")[1])
        rss = _rss(server.pid)
    health = json.loads(server.get("/health")[1])
    assert health["namespaces"] == IDLE + 4  # none freed: each holds a block
    grew = metrics - metrics0
    assert grew < 150 * KiB, f"/metrics grew {grew} B for {IDLE} idle namespaces"
    assert rss - rss0 < 100 * MiB, f"RSS grew {(rss - rss0) // MiB} MiB"
    assert len(stats["namespaces"]) == 16  # hit-rate state: the newest idle
