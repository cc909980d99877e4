"""Liveness (Session stream), CLI flags, HTTP endpoints and clean shutdown."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time

import pytest

import pegaflow.client.pegaflow_client
from pegaflow.client import session_stream
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import UnknownInstance
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, _env, wait_until


def test_sigkilled_engine_is_dropped_and_blocks_kept(server, engines) -> None:
    a = engines()
    a.call(
        "init",
        layout="LBNHC",
        layers=2,
        blocks=16,
        heads=2,
        block_size=16,
        head=64,
        seed=1,
    )
    a.call("register", addr=server.addr, instance="a", namespace="ns")
    hs = [secrets.token_hex(32) for _ in range(8)]
    a.call("save", block_ids=list(range(8)), hashes=hs)
    a.call("query", hashes=hs)  # a lease owned by a
    assert server.metric("pegaflow_active_leases") == 1
    a.kill()
    assert wait_until(lambda: server.metric("pegaflow_registered_workers") == 0)
    assert server.metric("pegaflow_active_leases") == 0  # its leases went with it
    assert server.metric("pegaflow_resident_blocks") == 8  # its blocks did not
    with (
        PegaflowClient(server.addr) as client,
        pytest.raises(UnknownInstance, match="instance_id"),
    ):
        client.query("a", [bytes.fromhex(h) for h in hs])


def test_session_close_drops_worker_and_reregister_survives(server) -> None:
    kv = LocalKV()
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        session = client.open_session("e", interval_s=0.2)
        kv.register(client, "e", "ns")  # re-registration replaces the worker...
        session.close()  # ...so the old session's end must not drop the new one
        time.sleep(0.3)
        assert client.query("e", hashes(1)).num_blocks == 0
        session = client.open_session("e")
        session.close()
        assert wait_until(lambda: server.metric("pegaflow_registered_workers") == 0)


def test_sessions_left_open_are_closed_at_exit(server) -> None:
    # A worker that never closes its session would leave the stream to
    # interpreter finalization (grpc's exit race); the atexit hook ends it.
    kv = LocalKV()
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        session = client.open_session("e", interval_s=60)
        assert wait_until(lambda: server.metric("pegaflow_registered_workers") == 1)
        session_stream.close_open_sessions()
        assert not session.alive
        assert wait_until(lambda: server.metric("pegaflow_registered_workers") == 0)
        session_stream.close_open_sessions()  # closed ones are forgotten


def test_health_and_metrics_endpoints(server) -> None:
    kv = LocalKV()  # alive until the save has read it
    with PegaflowClient(server.addr) as client:
        assert client.health()
        kv.register(client, "e", "ns")
        client.save("e", [0], hashes(1))  # over the fast-path socket
    status, body = server.get("/health")
    report = json.loads(body)
    assert status == 200 and report["status"] == "ok"
    assert report["pool_capacity_bytes"] == 64 << 20
    assert 0.0 <= report["pool_hugepage_share"] <= 1.0  # read from smaps
    status, body = server.get("/metrics")
    text = body.decode()
    for name in (
        "pegaflow_pool_capacity_bytes",
        "pegaflow_pool_used_bytes",
        "pegaflow_resident_blocks",
        "pegaflow_query_hit_blocks_total",
        "pegaflow_query_miss_blocks_total",
        "pegaflow_evictions_total",
        "pegaflow_admission_rejections_total",
        "pegaflow_transfer_bytes_total",
        "pegaflow_transfer_seconds_bucket",
        "pegaflow_rpc_seconds_bucket",
    ):
        assert name in text or name.replace("_total", "") in text, name
    saves = 'pegaflow_rpc_seconds_count{code="OK",method="Save",transport="unix"}'
    assert f"{saves} 1.0" in text
    assert (
        'pegaflow_rpc_seconds_count{code="OK",method="RegisterInstance",'
        'transport="unix"}' in text
    )
    assert server.get("/nope")[0] == 404


def test_sigterm_stops_cleanly(server_factory) -> None:
    server = server_factory("--pool-size", "8mb")
    kv = LocalKV()
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        session = client.open_session("e")
        assert server.stop(signal.SIGTERM) == 0
        assert "stopped" in server.log.read_text()
        assert not client.health(timeout_s=0.5)
        session.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--enable-rdma",), "need --metaserver-addr"),
        (("--nics", "mlx5_0"), "need --metaserver-addr"),
        (("--metaserver-addr", "x"), "argument --metaserver-addr: not a host:port"),
        (("--metaserver-addr", "10.9.9.9:1", "--remote-fetch-timeout", "nan"),
         "argument --remote-fetch-timeout"),
    ],
)  # fmt: skip
def test_remote_flags_checked(argv: tuple[str, ...], says: str) -> None:
    res = _cli(*argv)
    assert res.returncode == 2 and says in res.stderr, res.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--pool-size", "9" * 400), "argument --pool-size: not a size"),
        (("--pool-size", "1e400gb"), "argument --pool-size: not a size"),
        (("--max-concurrent-rpcs", "99999999999"), "argument --max-concurrent-rpcs"),
        (("--socket=",), "argument --socket: empty"),
        (("--ssd-cache-path", "/nonexistent-dir/x.bin", "--ssd-cache-capacity", "0"),
         "argument --ssd-cache-capacity"),
        (("--max-idle-namespaces", "-1"), "argument --max-idle-namespaces"),
    ],
)  # fmt: skip
def test_values_that_once_crashed_or_slipped_through(argv, says) -> None:
    """Each was a traceback (an int past what float or grpc's C int holds),
    a silent default (an SSD capacity of 0 became 512 GiB; an empty socket
    path turned the socket off) or named a config field, not the flag."""
    res = _cli("--no-http", "--addr", "127.0.0.1:0", *argv)
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_bad_flag_values() -> None:
    assert "not a size" in _cli("--pool-size", "lots").stderr
    assert "host:port" in _cli("--addr", "nowhere").stderr
    res = _cli("--pool-size", "16kb", "--no-http")
    assert res.returncode == 2 and "argument --pool-size" in res.stderr


def test_hugepages_without_reservation_fails_clearly() -> None:
    from pegaflow.cache.pool import _hugepages_free

    if _hugepages_free() > 0:
        pytest.skip("machine has hugepages reserved")
    res = _cli(
        "--use-hugepages", "--pool-size", "8mb", "--no-http", "--addr", "127.0.0.1:0"
    )
    assert res.returncode == 2 and "nr_hugepages" in res.stderr


def test_port_in_use_is_reported(server) -> None:
    res = _cli("--addr", server.addr, "--no-http", "--pool-size", "4mb")
    assert res.returncode == 2 and "--addr" in res.stderr


def test_engine_names_the_server_before_registering(server, monkeypatch) -> None:
    """Under Yama ptrace_scope 1 the server may read an engine's memory only
    once the engine named its pid; it reads it while registering, so the client
    asks ServerInfo and calls prctl(PR_SET_PTRACER) first, then registers over
    the unix socket (never gRPC: over TCP host memory is refused)."""
    steps: list[tuple[str, int]] = []
    monkeypatch.setattr(
        pegaflow.client.pegaflow_client,
        "allow_ptrace_from",
        lambda pid: steps.append(("allow", pid)),
    )
    kv = LocalKV()
    with PegaflowClient(server.addr) as client:
        real = client._grpc.call

        def traced(method: str, request: object, timeout_s: float) -> object:
            steps.append((method, 0))
            return real(method, request, timeout_s)

        client._grpc.call = traced
        kv.register(client, "e", "ns")
    assert steps == [("ServerInfo", 0), ("allow", server.pid)]
    assert server.metric(
        "pegaflow_rpc_seconds_count",
        'code="OK",method="RegisterInstance",transport="unix"',
    ) == pytest.approx(1)
