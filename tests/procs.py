"""Helpers that start real processes: the server CLI and scripted engines."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A server that serves no GPU answers a CPU test the same on a GPU host as on
# CI: with --devices auto there, its CUDA bring-up (after READY) grew the RSS
# that memory tests measure by 190-360 MiB, and a CUDA registration met a
# served GPU (H100 host, 2026-12-06).
HOST_ONLY = ("--devices", "none")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    return env


@dataclass
class ServerProc:
    proc: subprocess.Popen
    addr: str
    http: str
    pid: int
    log: Path
    args: list[str] = field(default_factory=list)
    start_s: float | None = None  # READY's: seconds from the exec to READY

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def metric(self, name: str, labels: str = "") -> float:
        _, body = self.get("/metrics")
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(
                name + (labels and "{" + labels)
            ) and not line.startswith("#"):
                head, value = line.rsplit(" ", 1)
                if head == name or head.startswith(name + "{"):
                    total += float(value)
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    tmp: Path,
    *args: str,
    timeout: float = 60.0,
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> ServerProc:
    """prefix: run under it (e.g. `ip netns exec NS`); env: extra variables."""
    log = tmp / f"server-{time.monotonic_ns()}.log"
    argv = [
        *prefix,
        sys.executable,
        "-m",
        "pegaflow.cli",
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--no-progress",
        "--log-level",
        "debug",
        *args,
    ]
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**_env(), **(env or {})},
            cwd=ROOT,
        )
    line = _readline(proc, timeout)
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}\n{log.read_text()}")
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return ServerProc(
        proc,
        fields["grpc"],
        fields["http"],
        int(fields["pid"]),
        log,
        argv,
        float(fields["start_s"]),
    )


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        return ""
    return proc.stdout.readline().decode().strip()


class EngineProc:
    """A separate engine process (tests/engine_worker.py) driven by JSON lines."""

    def __init__(
        self, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
    ) -> None:
        """env: extra variables (e.g. PYTORCH_CUDA_ALLOC_CONF for a GPU engine);
        prefix: run under it (e.g. `ip netns exec NS`)."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(ROOT / "tests" / "engine_worker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**_env(), **(env or {})},
            cwd=ROOT,
        )

    def call(self, op: str, timeout: float = 60.0, **kwargs: object) -> dict:
        self.proc.stdin.write((json.dumps({"op": op, **kwargs}) + "\n").encode())
        self.proc.stdin.flush()
        line = _readline(self.proc, timeout)
        if not line:
            raise RuntimeError(f"engine gave no answer to {op} (rc={self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{op}: {reply['error']}: {reply['message']}")
        return reply

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError, OSError):
                self.call("exit", timeout=10)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll until predicate() holds or `timeout` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())
