"""The original PegaFlow `pegaflow-server`'s command lines start this server.

Flags and values are those of the original's `--help` and docs/server.md
(0.23-0.25: 30 flags besides -h/-V). A flag this server cannot honour on this
machine is named with the reason it is left out of the started command line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pegaflow import __version__
from pegaflow.server.cli import build_parser
from pegaflow.server.compat_flags import IGNORED, SHARD_NAME
from tests.procs import ROOT, _env, _readline, start_server

# Started for real below (values from the original's docs, sizes shrunk to fit
# a CI machine): every original flag except those in NEEDS_MACHINE/MULTI_NODE.
STARTED = [
    ("--addr", "127.0.0.1:0"),
    ("--http-addr", "127.0.0.1:0"),
    ("--pool-size", "64mb"),
    ("--hint-value-size", "256kb"),
    ("--enable-lfu-admission",),
    ("--disable-numa-affinity",),
    ("--enable-prometheus",),
    ("--metrics-otel-endpoint", "http://127.0.0.1:4317"),
    ("--metrics-period-secs", "10"),
    ("--log-level", "warn"),
    ("--ssd-cache-capacity", "64mb"),
    ("--ssd-cache-shards", "2"),
    ("--ssd-write-queue-depth", "8"),
    ("--ssd-prefetch-queue-depth", "2"),
    ("--ssd-write-inflight", "2"),
    ("--ssd-prefetch-inflight", "16"),
    ("--max-prefetch-blocks", "800"),
    ("--trace-sample-rate", "0.01"),
    ("--pool-shards", "4"),
    ("--blockwise-alloc",),
    ("--qps-per-peer", "2"),
    ("--metaserver-queue-depth", "4096"),
    ("--metric-hll-windows", "15m,1h,24h"),
    ("--metric-hll-bucket-bits", "14"),
    ("--transfer-lock-timeout-secs", "120"),
]
# Honoured, but need what a CI machine lacks: reserved hugepages, a GPU.
NEEDS_MACHINE = [("--use-hugepages",), ("--devices", "0,1,2,3")]
# Refused with a clear message until the remote tier exists.
# The seeds' multi-node form, refused here for what this machine lacks, each
# with the message that names it: (flags, what stderr must say).
MULTI_NODE = [
    (("--nics", "mlx5_0", "mlx5_1"), "need --metaserver-addr"),
    (
        ("--metaserver-addr", "http://m:50056"),
        "loopback reaches only this host",
    ),
    (
        ("--addr", "0.0.0.0:0", "--metaserver-addr", "http://m:50056"),
        "a wildcard names no host",
    ),
    (
        ("--addr", "10.255.0.1:0", "--metaserver-addr", "http://m:50056",
         "--nics", "mlx5_0", "mlx5_1"),
        "no RDMA device 'mlx5_0'",
    ),
]  # fmt: skip


def _argv(flags: list[tuple[str, ...]]) -> list[str]:
    return [part for flag in flags for part in flag]


def test_every_original_flag_parses() -> None:
    """Scenario: the full original command line, the SSD path included; 21 of
    these flags used to stop the start with "unrecognized arguments"."""
    remote = [("--nics", "mlx5_0", "mlx5_1"), ("--metaserver-addr", "http://m:50056")]
    every = [*STARTED, *NEEDS_MACHINE, *remote, ("--ssd-cache-path", "/d1", "/d2")]
    assert len({flag[0] for flag in every}) == 30
    args = build_parser().parse_args(_argv(every))
    assert args.nics == ["mlx5_0", "mlx5_1"]
    assert args.ssd_cache_path == ["/d1", "/d2"]
    assert args.log_level == "warning"


def test_original_command_line_starts(tmp_path: Path) -> None:
    """Scenario: a user starts this server with the original's flags and a
    directory as --ssd-cache-path: it comes up (READY), lays out the shards in
    the directory, and names each ignored flag in one WARNING line."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    server = start_server(tmp_path, *_argv(STARTED), "--ssd-cache-path", str(ssd))
    try:
        status, body = server.get("/metrics")
        assert status == 200 and b"pegaflow_" in body
        shards = sorted(p.name for p in ssd.iterdir() if p.name.endswith(".cache"))
        assert shards == [SHARD_NAME.format(0), SHARD_NAME.format(1)]
    finally:
        assert server.stop() == 0
    log = server.log.read_text()
    warned = [line for line in log.splitlines() if "accepted and ignored" in line]
    assert warned and all(" WARNING " in line for line in warned)
    for flag in IGNORED:
        assert sum(f" {flag}" in line for line in warned) == 1, (flag, log)


@pytest.mark.parametrize("case", MULTI_NODE, ids=lambda c: " ".join(c[0][-2:]))
def test_multi_node_flags_checked_at_start(case: tuple[tuple[str, ...], str]) -> None:
    """Scenario: the seeds' multi-node form (`--nics mlx5_0 mlx5_1`, two values)
    parses; what cannot work here (no metaserver named, a loopback or wildcard
    --addr to advertise, an RDMA device this machine lacks: Mooncake would
    fall back to TCP silently) stops the start with exit 2 and names it."""
    flags, says = case
    if "--nics" in flags and "--metaserver-addr" in flags:
        from pegaflow.tiers.remote.nics import active_devices

        if "mlx5_0" in active_devices():
            pytest.skip("this machine has an active mlx5_0")
    proc = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "--pool-size", "4mb", *flags],
        capture_output=True,
        env=_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr.decode()
    assert says in proc.stderr.decode()


def test_version_flag() -> None:
    """Scenario: `pegaflow-server -V` (the original's) was unrecognized."""
    for flag in ("-V", "--version"):
        proc = subprocess.run(
            [sys.executable, "-m", "pegaflow.cli", flag],
            capture_output=True,
            env=_env(),
            cwd=ROOT,
            timeout=60,
        )
        assert proc.returncode == 0 and proc.stdout.decode().strip() == __version__


def test_devices_without_the_cuda_extra_names_it(tmp_path: Path) -> None:
    """Scenario: `--devices 0` where cuda-bindings is not installed said only
    "No module named 'cuda'"; it must name the extra to install."""
    shadow = tmp_path / "shadow" / "cuda"
    shadow.mkdir(parents=True)  # an import of cuda.* fails as when not installed
    (shadow / "__init__.py").write_text(
        "raise ImportError(\"No module named 'cuda'\")\n"
    )
    env = _env()
    env["PYTHONPATH"] = f"{shadow.parent}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "--pool-size", "4mb", "--no-http"]
        + ["--addr", "127.0.0.1:0", "--devices", "0", "--query-socket", "off"],
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert 'pip install "pegaflow-py[cuda]"' in err and "Traceback" not in err


def test_no_progress_frames_when_stderr_is_a_file(tmp_path: Path) -> None:
    """Scenario: under a service manager (stderr a file) the pool's pre-touch
    bar wrote \\r frames into the log; bars are for terminals (or --progress)."""
    log = tmp_path / "stderr.log"
    argv = [sys.executable, "-m", "pegaflow.cli", "--pool-size", "64mb"]
    argv += ["--addr", "127.0.0.1:0", "--no-http", "--query-socket", "off"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, env=_env(), cwd=ROOT
        )
    try:
        assert _readline(proc, 60).startswith("READY"), log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_bytes()
    assert b"\r" not in text and b"pool ready" in text
