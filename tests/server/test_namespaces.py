"""Namespaces through a real server: freed once empty, kept while they hold
blocks, bounded while idle, and never named to a client."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import InvalidRequest
from tests.kvbuf import LocalKV, hashes
from tests.procs import HOST_ONLY, ROOT, ServerProc, _env, wait_until
from tests.server.test_ssd_tier import _flags, _until_ready, _wait_flushed

CYCLES = 200


def _tag(name: str) -> str:
    return hashlib.sha256(b"pegaflow-ns-tag" + name.encode()).hexdigest()[:12]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _health(server: ServerProc) -> dict:
    return json.loads(server.get("/health")[1])


def _stats(server: ServerProc) -> dict:
    return json.loads(server.get("/stats")[1])  # also replays the hit-rate log


def _cycle(client: PegaflowClient, kv: LocalKV, name: str) -> None:
    kv.register(client, name, name)
    client.query(name, hashes(64))  # misses: hit-rate state for the namespace
    client.unregister(name)


@pytest.fixture
def server(server_factory: Callable[..., ServerProc]) -> ServerProc:
    return server_factory("--pool-size", "64mb", *HOST_ONLY)


def test_namespaces_of_departed_engines_are_freed(server: ServerProc) -> None:
    """Regression: CYCLES engines come and go, each in a namespace of its own:
    register, query, unregister, nothing saved. Every namespace used to stay
    with its hit-rate windows and /metrics series: /health counted them all,
    RSS grew ~0.5 MiB and /metrics ~1.6 KB per namespace. Now each is freed
    on unregister: the count is back to the live ones (one engine stays
    registered throughout), and RSS and /metrics stay near their start."""
    kv = LocalKV(layers=2, blocks=8)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "stays", "ns-stays")
        for i in range(8):  # warm up: every RPC and code path seen once
            _cycle(client, kv, f"warm-{i}")
        _stats(server)
        metrics0 = len(server.get("/metrics")[1])
        rss0 = _rss_kib(server.pid)
        for i in range(CYCLES):
            _cycle(client, kv, f"ns-{i}")
        stats = _stats(server)
        rss = _rss_kib(server.pid)
        metrics = len(server.get("/metrics")[1])
        assert _health(server)["namespaces"] == 1
        assert stats["pool"]["namespaces"] == 1
        assert stats["namespaces"] == []  # "stays" never queried
        # Before: +109 MiB and +280 KB over 200 cycles (now +0.3 MiB, +0.1 KB).
        assert rss - rss0 < 24 << 10, f"RSS grew {(rss - rss0) >> 10} MiB"
        assert metrics < metrics0 + 4096, (metrics0, metrics)


def test_namespace_with_blocks_is_kept_and_ids_are_not_reused(
    server: ServerProc,
) -> None:
    """Guard: engine "a" saves blocks in ns-keep and leaves; ns-keep holds
    resident blocks, so it is not empty and stays: engine "b" registering
    there later loads them byte for byte. And an id stays unique: ns-gone
    (registered before ns-keep, freed) must not hand its id to ns-new, or
    ns-new would see ns-keep's blocks under the aliased keys."""
    kv, kv2 = LocalKV(seed=1), LocalKV(seed=2)
    hs = hashes(16)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "gone", "ns-gone")
        kv.register(client, "a", "ns-keep")
        want = [kv.block(i).copy() for i in range(16)]
        assert client.save("a", list(range(16)), hs).stored == 16
        client.unregister("a")
        client.unregister("gone")
        assert _health(server)["namespaces"] == 1  # ns-keep only
        kv2.register(client, "new", "ns-new")
        assert client.query("new", hs).num_blocks == 0
        kv2.register(client, "b", "ns-keep")
        res = client.query("b", hs)
        assert res.num_blocks == 16
        dst = list(range(63, 47, -1))
        client.load("b", res.lease_id, dst)
        for i, b in enumerate(dst):
            assert np.array_equal(kv2.block(b), want[i]), f"block {i}"


def test_namespace_freed_with_its_last_block_finds_its_ssd_blocks(
    server_factory: Callable[..., ServerProc], tmp_path: Path
) -> None:
    """Regression: engine "a" saves 64 blocks in ns-ssd and leaves; engine "f"
    (another namespace) then fills the pool, so the 64 are spilled to SSD and
    with the last of them ns-ssd holds nothing in L1: it is freed (it used to
    stay forever). An engine registering ns-ssd again gets a new namespace
    whose SSD blocks are still found, loaded and byte-identical."""
    server = server_factory(*_flags(tmp_path))
    kv, filler, kv2 = LocalKV(seed=1), LocalKV(seed=3), LocalKV(seed=2)
    first = hashes(64)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "a", "ns-ssd")
        want = [kv.block(i).copy() for i in range(64)]
        assert client.save("a", list(range(64)), first).stored == 64
        client.unregister("a")
        filler.register(client, "f", "ns-filler")
        for _ in range(5):  # 5 x 64 x 16 KiB > the 4 MiB pool
            client.save("f", list(range(64)), hashes(64))
        _wait_flushed(server)
        assert server.metric("pegaflow_ssd_blocks") >= 64
        assert wait_until(lambda: _health(server)["namespaces"] == 1)
        kv2.register(client, "b", "ns-ssd")
        res = _until_ready(client, "b", first)
        assert res.num_blocks == 64
        dst = list(range(63, -1, -1))
        client.load("b", res.lease_id, dst)
        for i, b in enumerate(dst):
            assert np.array_equal(kv2.block(b), want[i]), f"block {i}"


def test_idle_namespaces_keep_hit_rates_up_to_the_bound(
    server_factory: Callable[..., ServerProc],
) -> None:
    """Regression: with --max-idle-namespaces 3, ten engines each save a block
    in a namespace of their own, query it and leave. Their blocks stay, so do
    the ten namespaces; only the three idle the shortest keep hit-rate state
    (and /metrics series). The flag did not exist."""
    server = server_factory("--pool-size", "64mb", "--max-idle-namespaces", "3")
    kv = LocalKV(layers=2, blocks=8)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        for i in range(10):
            name = f"idle-{i}"
            kv.register(client, name, name)
            hs = hashes(1)
            client.save(name, [0], hs)
            client.release_lease(client.query(name, hs).lease_id)
            client.unregister(name)
        assert _health(server)["namespaces"] == 10
        tags = {ns["tag"] for ns in _stats(server)["namespaces"]}
        assert tags == {_tag(f"idle-{i}") for i in (7, 8, 9)}
        text = server.get("/metrics")[1].decode()
        # Hit-rate series: the three only. (pegaflow_namespace_info lists every
        # namespace the registry keeps, which the pool's blocks bound.)
        rates = [ln for ln in text.splitlines() if ln.startswith("pegaflow_hit")]
        assert any(_tag("idle-9") in ln for ln in rates)
        assert not any(_tag("idle-0") in ln for ln in rates)


def _status(server: ServerProc) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "pegaflow", "status", "--http-addr", server.http],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_mismatch_errors_and_outputs_never_name_a_namespace(
    server: ServerProc,
) -> None:
    """Regression: engine "a" registers ns-private-name (4 layers, 16 KiB
    blocks); engines with another page size, layer count or TP size ask to
    join it. Their errors used to name the namespace and a's geometry; now
    they say only what differs from their own request. /metrics, /stats,
    `pegaflow-server status` and the server's INFO+ log lines label the
    namespace by its one-way tag, never its name."""
    name = "ns-private-name"
    kv, small, three = LocalKV(), LocalKV(page=2048), LocalKV(layers=3)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "a", name)
        client.query("a", hashes(4))
        for other in (small, three):  # a's blocks are 4 layers x 4096 B
            with pytest.raises(InvalidRequest) as err:
                other.register(client, "odd", name)
            msg = str(err.value)
            assert "layers: page geometry differs from this namespace's" in msg
            own = f"{other.layers} layers, {other.layers * other.page} B/block"
            assert msg.endswith(f"this request has {own}"), msg
            assert name not in msg and "16384" not in msg
        with pytest.raises(InvalidRequest) as err:
            kv.register(client, "odd", name, tp_size=2)
        msg = str(err.value)
        assert "tp_size" in msg and name not in msg and " 1 shard" not in msg
        outputs = {
            "/metrics": server.get("/metrics")[1].decode(),
            "/stats": server.get("/stats")[1].decode(),
            "/health": server.get("/health")[1].decode(),
            "status": _status(server),
        }
        for where, text in outputs.items():
            assert name not in text, where
        for where in ("/metrics", "/stats", "status"):
            assert _tag(name) in outputs[where], where
        client.unregister("a")
    server.stop()
    loud = [
        line
        for line in server.log.read_text().splitlines()
        if any(f" {lvl} " in line for lvl in ("INFO", "WARNING", "ERROR"))
    ]
    assert loud and not [line for line in loud if name in line]
