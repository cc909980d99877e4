"""The socket's server-wide backlog budget (socket_service.BACKLOG_BUDGET):
requests queued and replies unread over all connections, each queued request
charged its bytes and the most its reply can take. The real server runs with
the budget made small, as the tests of other limits make theirs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.socket_frames import (
    LOAD_REPLY,
    MAX_LOAD_ITEMS,
    encode_load,
    load_reply_bound,
    load_reply_size,
)
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc, wait_until
from tests.socket_tools import greeted, server_with_budget

BUDGET = 1 << 20


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProc]:
    proc = server_with_budget(tmp_path, BUDGET)
    yield proc
    proc.stop()


def _reply(sock: socket.socket) -> tuple[int, bytes]:
    """(status, the rest) of one reply: a load's, or an error's."""
    head = bytearray(sock.recv(5, socket.MSG_WAITALL))
    if head[0]:
        size = int.from_bytes(head[1:5], "little")
        return head[0], sock.recv(size, socket.MSG_WAITALL)
    reply = head + sock.recv(LOAD_REPLY.size - 5, socket.MSG_WAITALL)
    while len(reply) < (size := load_reply_size(reply)):
        reply += sock.recv(size - len(reply))
    return 0, bytes(reply)


def _loads(server: ServerProc) -> float:
    labels = 'code="OK",method="Load",transport="unix"'
    return server.metric("pegaflow_rpc_seconds_count", labels)


def test_a_first_request_is_charged_and_a_lone_one_always_served(server) -> None:
    """Scenario: a connection sends one load of the most items a load may
    name, its leases gone (a ~1.4 MiB reply), and never reads; another
    connection sends the same load. A connection's first request was never
    checked against the budget, so 1,024 such connections held ~1.5 GiB of
    replies until their unread timeout. Now the second is answered
    RESOURCE_EXHAUSTED naming the budget (its connection kept); once the first
    is gone it is served, though its charge alone (~1.9 MiB) is past the
    budget: an engine that reads each reply is served on an idle server."""
    kv = LocalKV(1, 8, 4096)
    with PegaflowClient(server.addr) as client:
        reg = kv.register(client, "e", "ns")
        token = client._token("e", 0)
    items = [(2 * i + 3, 0, np.zeros(0, np.int64)) for i in range(MAX_LOAD_ITEMS)]
    frame = encode_load("e", 0, items, True, token=token)
    assert frame is not None
    assert len(frame) + load_reply_bound(frame[4:]) > BUDGET
    with open("/proc/sys/net/core/wmem_default") as f:
        if int(f.read()) > 1 << 20:  # the kernel would hold the hog's reply
            pytest.skip("a socket buffer of over 1 MiB holds a whole reply")
    hog = greeted(reg.socket_path)
    late = greeted(reg.socket_path)
    try:
        hog.sendall(frame)
        assert wait_until(lambda: _loads(server) == 1)  # its reply waits unread
        late.sendall(frame)
        status, message = _reply(late)
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message
        assert message.startswith(b"request: "), message
        assert f"(at most {BUDGET}); retry".encode() in message, message
        assert server.metric("pegaflow_socket_refusals_total", 'reason="backlog"')
        # An engine's requests (each reply read before the next, each small)
        # are served past the budget: the hog cannot lock engines out.
        with PegaflowClient(server.addr) as client:
            other = kv.register(client, "f", "ns")
            assert other.socket_path == reg.socket_path  # over the socket
            assert client.save("f", [0, 1], hashes(2)).stored == 2
        hog.close()

        def served() -> bool:  # once the server has seen the hog go
            late.sendall(frame)
            return _reply(late)[0] == 0

        assert wait_until(served)
        for _ in range(2):  # one at a time, each reply read: served
            late.sendall(frame)
            status, reply = _reply(late)
            assert status == 0 and len(reply) > BUDGET, (status, reply[:200])
    finally:
        hog.close()
        late.close()


def _stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (SIGSTOP)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with (
            contextlib.suppress(FileNotFoundError),  # a thread that just ended
            open(f"/proc/{pid}/task/{tid}/stat") as f,
        ):
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(state == "T" for state in states)


def test_pipelined_loads_are_charged_the_replies_they_can_produce(tmp_path) -> None:
    """Scenario: 24 connections each pipeline two batch loads of 4,000 items
    naming no blocks (128 KiB of frames) and never read, the budget 8 MiB.
    Replies were charged at what the requests took, 1/7 of what such a load
    may answer (a row and a gone lease's line per item), so unread replies
    could pin far more than BACKLOG_BUDGET. Each load is now charged its
    longest reply while it waits (~0.4 MiB), so past the budget the
    connections that send more are refused. The server is stopped while they
    send, so every frame is waiting, none answered, when it reads them."""
    budget = 8 << 20
    server = server_with_budget(tmp_path, budget)
    kv = LocalKV(1, 8, 4096)
    with PegaflowClient(server.addr) as client:
        reg = kv.register(client, "e", "ns")
    items = [(2 * i + 3, 0, np.zeros(0, np.int64)) for i in range(4000)]
    # Not the registration's token: each is answered short, once it runs.
    frame = encode_load("e", 0, items, True, token=bytes(16))
    assert frame is not None
    socks = [greeted(reg.socket_path) for _ in range(24)]
    try:
        os.kill(server.pid, signal.SIGSTOP)
        try:
            # Stopped before the first byte: not woken by one on its way.
            assert wait_until(lambda: _stopped(server.pid))
            for sock in socks:  # the kernel holds them meanwhile
                sock.settimeout(5)
                sock.sendall(frame + frame)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        refused = []
        for sock in socks:
            status, body = _reply(sock)
            if status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                refused.append(body)
            else:
                assert status == grpc.StatusCode.PERMISSION_DENIED.value[0], body
        # 2 x 0.44 MiB a connection: ~9 of them fill the budget.
        assert 10 <= len(refused) <= 16, len(refused)
        assert f"(at most {budget})".encode() in refused[0], refused[0]
        with PegaflowClient(server.addr) as client:  # and it serves others
            kv.register(client, "f", "ns")
            assert client.save("f", [0, 1], hashes(2)).stored == 2
    finally:
        for sock in socks:
            sock.close()
        server.stop()
