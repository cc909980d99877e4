"""No copy after its deadline (issue: trust, "deadlines on every path").

The probe that found it: the server SIGSTOPped for longer than the engine's
timeout while a save or load waited in its socket; the engine gave up, reused
its pages, and the resumed server then stored the new page contents under the
old hash (a late save) or overwrote a reused block (a late load).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import ServerUnavailable
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc, start_server

TIMEOUT_S, GRACE_S = 1.0, 0.5


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path, "--pool-size", "16mb")
    yield proc
    proc.stop(signal.SIGKILL)


def _count(server: ServerProc, method: str, code: str) -> float:
    name, _, transport = method.partition("/")
    labels = f'code="{code}",method="{name}",transport="{transport or "grpc"}"'
    return server.metric("pegaflow_rpc_seconds_count", labels)


def _wait_for(server: ServerProc, method: str, code: str, at_least: float) -> None:
    """Until the server counted that many answers (it must: frames are never
    dropped unanswered); fails after 30 s."""
    end = time.monotonic() + 30
    while _count(server, method, code) < at_least:
        assert time.monotonic() < end, f"{method} never answered {code}"
        time.sleep(0.05)


def _stopped(server: ServerProc):  # noqa: ANN202 - a tiny context manager
    class Stopped:
        def __enter__(self) -> None:
            os.kill(server.pid, signal.SIGSTOP)

        def __exit__(self, *exc: object) -> None:
            os.kill(server.pid, signal.SIGCONT)

    return Stopped()


@pytest.mark.parametrize("via_socket", [True, False], ids=["socket", "grpc"])
def test_a_late_save_is_never_published(server, via_socket: bool) -> None:
    """Scenario: save sent, server stopped past the deadline, the engine gives
    up and writes new bytes into those pages, server resumed: the hashes must
    not come to name the new bytes (nor anything)."""
    kv = LocalKV(4, 16, 4096, seed=1)
    with PegaflowClient(server.addr, TIMEOUT_S, copy_grace_s=GRACE_S) as client:
        kv.register(client, "e", "ns")
        if not via_socket:
            client.disable_socket()
        hs = hashes(4)
        method = "Save/unix" if via_socket else "Save"
        before = _count(server, method, "DEADLINE_EXCEEDED")
        with _stopped(server):
            with pytest.raises(ServerUnavailable):
                client.save("e", [0, 1, 2, 3], hs)
            kv.randomize([0, 1, 2, 3], seed=2)  # the engine reuses its pages
        if via_socket:  # the frame waited in the socket: it must be refused
            _wait_for(server, method, "DEADLINE_EXCEEDED", before + 1)
        assert client.query("e", hs).num_blocks == 0
        assert client.save("e", [0, 1, 2, 3], hs).stored == 4  # still serves


@pytest.mark.parametrize("via_socket", [True, False], ids=["socket", "grpc"])
def test_a_late_load_never_writes(server, via_socket: bool) -> None:
    """Scenario: load sent, server stopped past the deadline, the engine gives
    up and recomputes into the destination blocks, server resumed: those
    blocks keep the engine's bytes."""
    kv = LocalKV(4, 16, 4096, seed=3)
    with PegaflowClient(server.addr, TIMEOUT_S, copy_grace_s=GRACE_S) as client:
        kv.register(client, "e", "ns")
        hs = hashes(4)
        assert client.save("e", [0, 1, 2, 3], hs).stored == 4
        hit = client.query("e", hs)
        assert hit.num_blocks == 4
        if not via_socket:
            client.disable_socket()
        method = "Load/unix" if via_socket else "Load"
        before = _count(server, method, "DEADLINE_EXCEEDED")
        dst = [8, 9, 10, 11]
        with _stopped(server):
            with pytest.raises(ServerUnavailable):
                client.load("e", hit.lease_id, dst)
            kv.randomize(dst, seed=4)  # recomputed by the engine meanwhile
            mine = [kv.block(b).copy() for b in dst]
        if via_socket:
            _wait_for(server, method, "DEADLINE_EXCEEDED", before + 1)
        else:  # gRPC requests are taken in order: this one follows the late one
            client.query("e", hs)
        for b, want in zip(dst, mine, strict=True):
            assert np.array_equal(kv.block(b), want), b


def test_deadline_from_another_clock_is_refused(server) -> None:
    """A deadline an hour or more ahead of this host's monotonic clock cannot
    be ours (another time namespace): refused naming the field."""
    from pegaflow.common.socket_frames import encode_save

    kv = LocalKV(1, 16, 4096)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        far = time.monotonic_ns() + int(7200e9)
        frame = encode_save(
            "e", 0, np.array([0]), hashes(1), (), 0, far, client._token("e", 0)
        )
        with pytest.raises(Exception, match="deadline_ns: .* ahead"):
            client._socket.connection().save(frame, 10)
