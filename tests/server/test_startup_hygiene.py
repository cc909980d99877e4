"""Start-up and shutdown hygiene of the real server CLI: flags checked before
anything starts, one-line errors naming the flag (exit 2, no traceback), no file
deleted or socket file left behind, a private socket, a quiet SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV
from tests.procs import ROOT, _env, _readline

UNASSIGNABLE = "10.255.255.1"  # a private address this machine does not hold


def _failed_start(*args: str, timeout: float = 60.0) -> tuple[int, str]:
    """Run the CLI expecting it to refuse: (exit code, stderr). A server that
    comes up instead (READY) is stopped and the test fails."""
    argv = [sys.executable, "-m", "pegaflow.cli", "--no-progress", *args]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )
    line = _readline(proc, timeout)
    if line.startswith("READY"):
        proc.kill()
        proc.communicate()
        pytest.fail(f"server started although it should refuse: {args}")
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode()


def _local(*args: str) -> list[str]:
    return ["--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", *args]


def _one_line(err: str) -> str:
    """The message, after any log lines; never a traceback."""
    assert "Traceback" not in err and "[Errno" not in err, err
    return err.strip().splitlines()[-1]


def test_query_socket_on_a_regular_file_keeps_the_file(tmp_path: Path) -> None:
    """Scenario: --query-socket names an existing regular file (a typo); the old
    server unlinked it and put its socket there."""
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"precious")
    rc, err = _failed_start(
        *_local("--pool-size", "4mb", "--query-socket", str(victim))
    )
    line = _one_line(err)
    assert rc == 2 and "--socket" in line and "not a socket" in line
    assert victim.read_bytes() == b"precious"


def test_query_socket_is_private_and_removed_at_stop(server_factory, tmp_path) -> None:
    """Scenario: the socket was created with the umask's mode and chmodded
    later. Right after READY it is 0600 (the moment of bind: tests/unit/
    test_sockfile.py), and at stop its file is gone."""
    path = tmp_path / "q.sock"
    server = server_factory("--pool-size", "4mb", "--query-socket", str(path))
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert server.stop() == 0 and not os.path.lexists(path)


def test_stale_socket_is_replaced_and_live_one_refused(server_factory, tmp_path):
    """Scenario: a server died leaving its socket file: the next one on that
    path removes it (INFO) and serves. A third, while the second lives, must
    refuse rather than steal the path."""
    path = tmp_path / "q.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    live = server_factory("--pool-size", "4mb", "--query-socket", str(path))
    assert "stale socket" in live.log.read_text()
    ino = os.lstat(path).st_ino
    rc, err = _failed_start(*_local("--pool-size", "4mb", "--query-socket", str(path)))
    assert rc == 2 and "another server is listening" in _one_line(err)
    assert os.lstat(path).st_ino == ino and live.get("/health")[0] == 200


def test_missing_socket_directory(tmp_path: Path) -> None:
    path = tmp_path / "nonexistent" / "dir" / "x.sock"
    rc, err = _failed_start(*_local("--pool-size", "4mb", "--query-socket", str(path)))
    line = _one_line(err)
    assert rc == 2 and "--socket" in line and "does not exist" in line


def test_http_port_in_use_fails_before_the_pool(tmp_path: Path) -> None:
    """Scenario: the HTTP port is taken. The old server found out only after
    pre-touching the pool, and left its query socket file behind."""
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    path = tmp_path / "q.sock"
    try:
        rc, err = _failed_start(
            "--addr", "127.0.0.1:0", "--http-addr", f"127.0.0.1:{port}",
            "--pool-size", "4mb", "--query-socket", str(path), "--log-level", "info",
        )  # fmt: skip
    finally:
        taken.close()
    line = _one_line(err)
    assert rc == 2 and "--http-addr" in line and "in use" in line
    assert "pool ready" not in err  # refused before the pool was touched
    assert not os.path.lexists(path)


def test_grpc_port_in_use(server) -> None:
    rc, err = _failed_start("--addr", server.addr, "--no-http", "--pool-size", "4mb")
    line = _one_line(err)
    assert rc == 2 and "--addr" in line and "in use" in line


@pytest.mark.parametrize("flag", ["--addr", "--http-addr"])
def test_unassignable_address(flag: str) -> None:
    probe = socket.socket()
    try:
        probe.bind((UNASSIGNABLE, 0))
        pytest.skip(f"this machine holds {UNASSIGNABLE}")
    except OSError:
        pass
    finally:
        probe.close()
    args = {"--addr": "127.0.0.1:0", "--http-addr": "127.0.0.1:0"}
    args[flag] = f"{UNASSIGNABLE}:0"
    rc, err = _failed_start(
        *(part for kv in args.items() for part in kv), "--pool-size", "4mb"
    )
    line = _one_line(err)
    assert rc == 2 and line.startswith(f"pegaflow-server: {flag}:")
    assert "not an address of this machine" in line


def test_pool_larger_than_memory() -> None:
    """Scenario: --pool-size beyond the machine's memory printed '[Errno 12]'."""
    rc, err = _failed_start(*_local("--pool-size", "64tb"))
    line = _one_line(err)
    assert rc == 2 and "--pool-size" in line and "MemAvailable" in line
    assert "e.g. --pool-size" in line


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--lease-ttl", "nan"),
        ("--lease-ttl", "inf"),
        ("--copy-threads", "0"),
        ("--prefault-threads", "0"),
        ("--copy-ctas", "100000"),
        ("--cuda-event-timeout", "inf"),
        ("--metric-hll-bucket-bits", "40"),
        ("--metric-hll-windows", "infs"),
        ("--pool-check-rate", "100"),
    ],
)
def test_numeric_flags_are_checked(flag: str, value: str) -> None:
    """Scenario: --lease-ttl nan/inf was accepted (leases never expired, one
    unconsumed query pinned the pool); every numeric flag is checked alike."""
    rc, err = _failed_start(*_local("--pool-size", "4mb", flag, value))
    assert rc == 2 and f"error: argument {flag}:" in err, err


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pegaflow", "status", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_status_pointed_at_the_grpc_port(server) -> None:
    """Scenario: `pegaflow-server status --http-addr <the gRPC port>` printed a
    traceback (http.client.BadStatusLine is no OSError)."""
    for addr, says in [(server.addr, "not with HTTP"), ("127.0.0.1:9", "refused")]:
        res = _status("--http-addr", addr)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "--http-addr" in lines[0]


@pytest.mark.parametrize("value", ["1e400", "nan", "-1", "0"])
def test_status_timeout_is_checked(value: str) -> None:
    """A timeout of 1e400 was a traceback; NaN or -1 a misleading "did not
    answer with pegaflow /stats JSON"."""
    res = _status("--timeout", value)
    assert res.returncode == 2 and "argument --timeout" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_sigterm_with_a_session_open_is_quiet(server_factory) -> None:
    """Scenario: SIGTERM while an engine holds its Session stream open; grpc
    cancelled the stream's task as the loop closed and logged a CancelledError
    traceback."""
    server = server_factory("--pool-size", "4mb")
    with PegaflowClient(server.addr) as client:
        LocalKV().register(client, "e", "ns")
        session = client.open_session("e")
        assert server.stop(signal.SIGTERM) == 0
        session.close()
    log = server.log.read_text()
    assert "stopped" in log
    assert "Traceback" not in log and "CancelledError" not in log, log


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--ssd-queue-blocks", "-1"),
        ("--ssd-write-inflight", "0"),
        ("--ssd-prefetch-inflight", "100000"),
    ],
)
def test_ssd_flags_are_checked_without_an_ssd_tier(flag: str, value: str) -> None:
    """Scenario: `--ssd-queue-blocks -1` and no --ssd-cache-path started the
    server; a value that would be refused with a tier is refused without one."""
    rc, err = _failed_start(*_local("--pool-size", "4mb", flag, value))
    line = _one_line(err)
    assert rc == 2 and flag in line, err
