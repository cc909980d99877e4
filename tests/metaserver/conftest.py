"""A real pegaflow-metaserver process per test, and nodes that talk to it."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pegaflow.common import peer_auth
from pegaflow.metaserver.meta_client import MetaClient
from tests.procs import ROOT, ServerProc, _env, _readline

_ids = itertools.count(1)


def start_metaserver(
    tmp: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
    prefix: tuple[str, ...] = (),
) -> ServerProc:
    """prefix: run under it (e.g. `ip netns exec NS`)."""
    log = tmp / f"metaserver-{time.monotonic_ns()}.log"
    argv = [*prefix, sys.executable, "-m", "pegaflow.metaserver"]
    if not any(a.startswith("--addr") for a in args):
        argv += ["--addr", "127.0.0.1:0"]
    argv += ["--http-addr", "127.0.0.1:0", "--log-level", "debug", *args]
    # A token in the caller's environment would guard every test's metaserver.
    base = {k: v for k, v in _env().items() if k != peer_auth.ENV_VAR}
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**base, **(env or {})},
            cwd=ROOT,
        )
    line = _readline(proc, timeout)
    if not line.startswith("READY"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"metaserver did not start: {line!r}\n{log.read_text()}")
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return ServerProc(
        proc, fields["grpc"], fields["http"], int(fields["pid"]), log, argv
    )


def wait_for(check: Callable[[], bool], deadline_s: float, what: str) -> None:
    """Poll `check` until it holds; fail naming `what` after deadline_s."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(0.05)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def hashes(count: int, length: int = 32) -> list[bytes]:
    return [os.urandom(length) for _ in range(count)]


@pytest.fixture
def metaserver_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProc]]:
    started: list[ServerProc] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProc:
        srv = start_metaserver(tmp_path, *args, env=env)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def node_factory() -> Iterator[Callable[..., MetaClient]]:
    made: list[MetaClient] = []

    def make(
        srv: ServerProc,
        name: str | None = None,
        incarnation: int = 1,
        token: str | None = None,
    ) -> MetaClient:
        client = MetaClient(
            srv.addr, name or f"node-{next(_ids)}", incarnation, token=token
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
