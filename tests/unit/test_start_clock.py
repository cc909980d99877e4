"""pegaflow.server.start_clock: a start's seconds from the exec, step by step,
in the log and on the READY line of a real server."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pegaflow.server import start_clock
from tests.procs import ROOT, start_server


def test_since_exec_counts_from_the_exec_not_the_import() -> None:
    """A process that slept before importing the clock still counts the
    sleep: the kernel's start time of the process, not the module's."""
    code = (
        "import time; time.sleep(0.4)\n"
        "from pegaflow.server import start_clock\n"
        "print(start_clock.since_exec(), start_clock.since_exec_now())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, check=True
    )
    coarse, fine = map(float, out.stdout.split())
    assert 0.38 <= coarse < 30 and 0.38 <= fine < 30
    assert abs(fine - coarse) < 0.1


def test_steps_are_each_steps_own_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        start_clock, "_marks", [("imports", 0.5), ("pool", 1.25), ("grpc", 1.5)]
    )
    assert start_clock.steps() == {"imports": 0.5, "pool": 0.75, "grpc": 0.25}


def test_a_servers_ready_line_and_log_name_its_start(tmp_path: Path) -> None:
    """READY carries start_s; the log line before it lists the steps, which
    add up to about that total."""
    server = start_server(tmp_path, "--pool-size", "16mb")
    try:
        assert server.stop(signal.SIGTERM, timeout=30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.log.read_text()
    line = re.search(r"started in ([0-9.]+) s since exec: (.*)", log)
    assert line, log
    total = float(line.group(1))
    steps = dict(part.rsplit(" ", 1) for part in line.group(2).split(", "))
    assert {"interpreter and imports", "pool", "grpc start", "serving"} <= set(steps)
    assert abs(sum(map(float, steps.values())) - total) < 0.1
    # READY comes after the log is flushed (at most 1 s on a stuck stderr)
    assert server.start_s is not None and total - 0.01 <= server.start_s < total + 2
