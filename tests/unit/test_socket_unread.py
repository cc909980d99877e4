"""A socket connection whose replies lie unread (a client that sends one
request with a large reply and never reads, on each of many connections)
held the server's memory for ever: the server-wide backlog bound is checked
as requests arrive, and a lone request passes it whatever its size. Now a
connection whose buffered replies do not move for UNREAD_TIMEOUT_S is
closed; one that reads them, however slowly, is kept. Run in-process
against the real socket server with a stand-in engine (the timeout made
short)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pegaflow.common.socket_frames import HELLO_REPLY, encode_hello, encode_load
from pegaflow.server import socket_service
from pegaflow.server.metrics import Metrics

ITEMS = 16384  # each answered with a 200-byte error, cut: a reply of ~3.4 MiB
UNREAD_S = 2.0


class StandInEngine:
    metrics = Metrics()

    async def load(self, ident, rank, items, *rest, **kw):
        item = types.SimpleNamespace(loaded=0, bytes=0, error="x" * 200)
        items = [item] * len(items)
        return types.SimpleNamespace(loaded=0, bytes=0, items=items, in_flight=False)


@pytest.fixture
def served(tmp_path: Path, monkeypatch) -> Iterator[tuple[str, list]]:
    monkeypatch.setattr(socket_service, "UNREAD_TIMEOUT_S", UNREAD_S)
    shareds: list = []
    real = socket_service._Shared

    def recorded(*args: object) -> object:
        shareds.append(real(*args))
        return shareds[-1]

    monkeypatch.setattr(socket_service, "_Shared", recorded)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    path = str(tmp_path / "s.sock")
    info = socket_service.SocketServerInfo(os.getpid(), bytes(16), path)
    start = socket_service.start_socket_server(path, StandInEngine(), info)
    server = asyncio.run_coroutine_threadsafe(start, loop).result(10)
    yield path, shareds
    loop.call_soon_threadsafe(server.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _greeted(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(encode_hello())
    assert sock.recv(HELLO_REPLY.size, socket.MSG_WAITALL)[0] == 0
    return sock


def _load() -> bytes:
    return encode_load("e", 0, [(i + 1, 0, np.array([0])) for i in range(ITEMS)], True)


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_replies_left_unread_close_their_connection(served) -> None:
    path, (shared,) = served[0], served[1]
    idle = _greeted(path)  # an engine between requests: never closed
    stuck = _greeted(path)
    stuck.sendall(_load())
    assert _wait(lambda: shared.backlog > 0)
    assert _wait(lambda: shared.connections == 1), shared.connections
    assert shared.backlog == 0
    stuck.settimeout(2)
    with pytest.raises((ConnectionResetError, OSError)):
        while stuck.recv(1 << 20):  # what the kernel held, then the reset
            pass
        raise ConnectionResetError("closed")
    idle.close()
    stuck.close()


def test_replies_read_slowly_keep_their_connection(served) -> None:
    """32 KiB every 50 ms: the kernel wakes the writer once a quarter of its
    buffer is free (unix sockets), well within the timeout."""
    path, (shared,) = served[0], served[1]
    slow = _greeted(path)
    slow.sendall(_load())
    size, start = 0, time.monotonic()
    while got := slow.recv(32 << 10):
        size += len(got)
        if size >= _reply_bytes():
            break
        time.sleep(0.05)
    assert size == _reply_bytes()
    assert time.monotonic() - start > 2 * UNREAD_S  # it took longer than that
    assert shared.connections == 1
    slow.close()


def _reply_bytes() -> int:
    from pegaflow.common.socket_frames import load_reply

    item = types.SimpleNamespace(loaded=0, bytes=0, error="x" * 200)
    return len(load_reply(0, 0, [item] * ITEMS))
