"""A keeper the server just started (pegaflow.cache.pool_claim.publish, also
how a server re-seeds a keeper that died) held for an instant by a probe: a
real keeper process, and a connection to it that claims the pool first."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from pegaflow.cache import pool_claim
from tests.keeper_tools import free, keeper_pid


def _probe_first(monkeypatch, hold_s: float, seen: list) -> None:
    """Each keeper publish starts is claimed by a probe before publish claims
    it, and let go `hold_s` later (as `keeper_pid` does, only slower)."""
    real = pool_claim.start_keeper

    def started_then_probed(path: str, fd: int) -> None:
        real(path, fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        seen.append(socket.recv_fds(sock, 64, 1)[0])  # the pool, claimed
        threading.Timer(hold_s, sock.close).start()

    monkeypatch.setattr(pool_claim, "start_keeper", started_then_probed)


def test_a_keeper_held_by_a_probe_is_claimed_once_the_probe_lets_go(
    monkeypatch, tmp_path: Path
) -> None:
    """Before, publish gave up at once ("held by pid ..."): a re-seeding
    server was left with no keeper, its pool lost with it (CI, session 17)."""
    seen: list = []
    _probe_first(monkeypatch, 0.3, seen)
    path = str(tmp_path / "pool.sock")
    fd = pool_claim.new_memfd(1 << 20, 4096)
    try:
        start = time.monotonic()
        c = pool_claim.publish(path, fd)
        assert seen == [pool_claim.OK]  # the probe held it first
        assert time.monotonic() - start >= 0.25  # and publish waited for it
        assert c.keeper_pid == keeper_pid(Path(path)) != os.getpid()
        c.sock.close()
    finally:
        free(Path(path))
        os.close(fd)


def test_a_keeper_held_past_the_wait_is_refused_naming_the_holder(
    monkeypatch, tmp_path: Path
) -> None:
    seen: list = []
    _probe_first(monkeypatch, 0.8, seen)
    monkeypatch.setattr(pool_claim, "HELD_RETRY_S", 0.2)
    path = str(tmp_path / "pool.sock")
    fd = pool_claim.new_memfd(1 << 20, 4096)
    try:
        with pytest.raises(pool_claim.PoolFileError, match="held by pid"):
            pool_claim.publish(path, fd)
    finally:
        time.sleep(0.9)  # the probe lets go: the keeper can be freed
        free(Path(path))
        os.close(fd)
