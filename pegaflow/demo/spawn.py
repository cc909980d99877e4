"""Start `pegaflow-server` as a child process and wait for its READY line."""

from __future__ import annotations

import subprocess
import sys
from typing import IO


def spawn_server(
    *args: str,
    timeout_s: float = 120.0,
    python_args: tuple[str, ...] = (),
    stderr: IO[bytes] | None = None,
) -> tuple[subprocess.Popen, str]:
    """(process, gRPC address) of a server on a free loopback port.
    python_args go before `-m pegaflow.cli` (benchmarks: `-m cProfile -o F`);
    stderr: where its log goes (default: this process's stderr)."""
    cli = ["-m", "pegaflow.cli", "--addr", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, *python_args, *cli, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    # The server prints READY only after the pool is up and gRPC listens.
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"pegaflow-server did not start: {line!r}")
    return proc, line.split()[1].split("=", 1)[1]
