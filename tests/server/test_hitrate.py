"""Hit rate, ceiling and miss causes through a real server: /metrics, /stats and
`pegaflow-server status`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

from benchmarks.interference import path_counts
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.keys import namespace_tag
from pegaflow.server.cli import build_parser, config_from_args
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, ServerProc, _env

POOL = ("--pool-size", "4mb")  # ~240 slots of 16 KiB blocks (4 layers x 4 KiB)


def _status(server: ServerProc, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pegaflow", "status", "--http-addr", server.http, *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def _fill(client: PegaflowClient, kv: LocalKV, n: int) -> None:
    for _ in range(n // kv.blocks):
        client.save("e", list(range(kv.blocks)), hashes(kv.blocks))


def _causes(server: ServerProc) -> dict[str, float]:
    return {
        c: server.metric("pegaflow_query_miss_blocks_by_cause_total", f'cause="{c}"')
        for c in ("compulsory", "capacity", "admission", "pool_full", "remote")
    }


def test_miss_causes_add_up_beside_the_ceiling(
    server_factory: Callable[..., ServerProc],
) -> None:
    """Fresh blocks miss (compulsory), hit once saved (ram), miss again once the
    pool has been refilled past them (capacity); TinyLFU then refuses a scan
    whose blocks miss as admission. Every scrape adds up to the queried blocks."""
    server = server_factory(*POOL, "--metric-hll-windows", "1m,1h")
    kv = LocalKV(layers=4, blocks=64, page=4096, seed=11)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "e", "model-a")
        hs = hashes(64)
        assert client.query("e", hs).num_blocks == 0
        client.save("e", list(range(64)), hs)
        client.release_lease(client.query("e", hs).lease_id)
        _fill(client, kv, 256)  # 4 MiB of newer blocks: hs is evicted
        assert client.query("e", hs).num_blocks == 0
        assert _causes(server) == {
            "compulsory": 64,
            "capacity": 64,
            "admission": 0,
            "pool_full": 0,
            "remote": 0,
        }
        hit = server.metric("pegaflow_query_hit_blocks_total")
        miss = server.metric("pegaflow_query_miss_blocks_total")
        assert (hit, miss) == (64, 128)
        tag = namespace_tag("model-a")  # the label: never the name itself
        tier = f'namespace="{tag}",tier="{{}}"'.format
        assert server.metric("pegaflow_query_blocks_total", tier("ram")) == 64
        assert server.metric("pegaflow_query_blocks_total", tier("miss")) == 128
        for t in ("ssd", "remote"):  # exported, zero until those tiers exist
            assert f'tier="{t}"' in server.get("/metrics")[1].decode()
        win = f'namespace="{tag}",window="1m"'
        assert server.metric("pegaflow_window_query_blocks", win) == 192
        assert server.metric("pegaflow_hit_rate", win) == pytest.approx(1 / 3)
        # 192 queried, 64 distinct: r* = 2/3, the measured gap is capacity's
        # (HLL may count a block short when two share a register: 3 % odds)
        ceiling = server.metric("pegaflow_hit_rate_ceiling", win)
        assert ceiling == pytest.approx(2 / 3, abs=0.015)

        status = _status(server)
        assert status.returncode == 0, status.stderr
        assert tag in status.stdout and "capacity 50.0%" in status.stdout
        assert "model-a" not in status.stdout
        stats = json.loads(_status(server, "--json").stdout)
        (ns,) = stats["namespaces"]
        assert ns["tag"] == tag and "name" not in ns
        assert ns["misses"]["capacity"] == 64 and ns["hits"]["ram"] == 64
        assert list(ns["windows"]) == ["1m", "1h"]
        # host engines only: no GPU copy policy to report, and the
        # interference benchmark's reader of /stats then counts zeros
        assert stats["copy_path"] is None
        assert "pegaflow_copy_path" not in server.get("/metrics")[1].decode()
        assert path_counts(server.http) == {"kernel": 0, "dma": 0, "switches": 0}


def test_tinylfu_refusals_show_as_admission_misses(
    server_factory: Callable[..., ServerProc],
) -> None:
    server = server_factory(*POOL, "--enable-lfu-admission")
    kv = LocalKV(layers=4, blocks=64, page=4096, seed=12)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "e", "model-b")
        _fill(client, kv, 256)  # the pool is full
        hot = hashes(64)
        for _ in range(3):  # queried (and missed) often before being saved
            client.query("e", hot)
        client.save("e", list(range(64)), hot)
        scan = hashes(64)
        client.save("e", list(range(64)), scan)  # cold: refused
        assert client.query("e", scan).num_blocks == 0
        causes = _causes(server)
        assert causes["admission"] == 64 and causes["compulsory"] == 192
        assert server.metric("pegaflow_admission_rejections_total") >= 64


def test_status_subcommand_keeps_the_daemon_flags() -> None:
    """`status` is a subcommand only as the first word: the flag interface is
    unchanged, and a server that does not answer is reported, not a trace."""
    args = build_parser().parse_args(["--pool-size", "8gb"])
    assert config_from_args(args).pool.size_bytes == 8 << 30
    res = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "status", "--http-addr", "127.0.0.1:9"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2 and "nothing listens at 127.0.0.1:9" in res.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "--metric-hll-windows", "5 minutes"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "not a duration" in bad.stderr


def test_demo_ceiling_not_below_hit_rate(
    server_factory: Callable[..., ServerProc],
) -> None:
    """Scenario: `python -m pegaflow.demo` (engine A saves, engine B queries
    first and hits all) left `status` showing hit rate 100 % beside a ceiling
    of 0.3 %: blocks saved before their first query counted as never seen."""
    server = server_factory("--pool-size", "64mb")
    demo = subprocess.run(
        [sys.executable, "-m", "pegaflow.demo", "--addr", server.addr]
        + ["--tokens", "1600", "--layers", "2"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    stats = json.loads(_status(server, "--json").stdout)
    (ns,) = stats["namespaces"]
    for label, window in ns["windows"].items():
        assert window["hit_rate"] > 0.4, (label, window)  # B hit every block
        assert window["ceiling"] >= window["hit_rate"], (label, window)
