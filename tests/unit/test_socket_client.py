"""The engine's socket client (pegaflow.client.socket_transport) against a
peer whose reply lies about its length. The client read as many bytes as a
reply's length field said (an error message's u32, a registration's): 1 GiB
asked of one recv (allocated before a byte came), then a wait for bytes that
never come until the request's timeout. Now a length past what the protocol
allows is a ConnectionError at once, and the connection is dropped."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pegaflow.client.socket_transport import SocketClient
from pegaflow.common.socket_frames import (
    HELLO_REPLY,
    MAX_ERROR_MESSAGE,
    MAX_REPLY,
    PROTOCOL_VERSION,
    REGISTER_REPLY,
    encode_query,
    encode_register,
)

SERVER_ID = bytes(range(16))
WAIT_S = 3.0


def _read_frame(conn: socket.socket) -> bytes:
    size = int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")
    return conn.recv(size, socket.MSG_WAITALL)


@pytest.fixture
def lying_peer(tmp_path: Path) -> Iterator[tuple[str, list[bytes]]]:
    """A socket that greets as a server would, then answers the first request
    with the reply the test puts in the list (and keeps the connection open)."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    replies: list[bytes] = []
    held: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        held.append(conn)
        _read_frame(conn)  # the hello
        conn.sendall(HELLO_REPLY.pack(0, PROTOCOL_VERSION, SERVER_ID))
        _read_frame(conn)
        conn.sendall(replies[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, replies
    thread.join(10)
    for conn in held:
        conn.close()
    listener.close()


def _client(path: str) -> SocketClient:
    return SocketClient(path, WAIT_S, SERVER_ID, os.getpid())


def test_an_error_message_longer_than_any_is_refused_at_once(lying_peer) -> None:
    path, replies = lying_peer
    replies.append(bytes([3]) + (1 << 30).to_bytes(4, "little") + b"short")
    client = _client(path)
    frame = encode_query("e", [bytes(32)])
    assert frame is not None
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"at most {MAX_ERROR_MESSAGE}"):
        client.query(frame, WAIT_S)
    assert time.monotonic() - start < WAIT_S / 2
    client.close()


def test_a_reply_longer_than_any_is_refused_at_once(lying_peer) -> None:
    path, replies = lying_peer
    replies.append(REGISTER_REPLY.pack(0, 1 << 31) + b"short")
    client = _client(path)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"at most {MAX_REPLY}"):
        client.register(encode_register(b"", 0), WAIT_S)
    assert time.monotonic() - start < WAIT_S / 2
    client.close()


def test_a_later_threads_refused_hello_falls_back_as_a_socket_gone(
    tmp_path: Path,
) -> None:
    """The first connection greets; a second thread's is refused at its
    hello (the server's connection cap, or a hello it timed out). That
    refusal came out typed (a PegaflowError), which the calls' fallback to
    gRPC does not catch: the save or load failed. Now it is a
    ConnectionRefusedError (an OSError), as for a socket gone; the first
    connection's refusal stays typed (the link records it)."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(2)
    held: list[socket.socket] = []
    refusal = b"too many"
    error = bytes([8]) + len(refusal).to_bytes(4, "little") + refusal

    def serve() -> None:
        for reply in (HELLO_REPLY.pack(0, PROTOCOL_VERSION, SERVER_ID), error):
            conn, _ = listener.accept()
            held.append(conn)
            _read_frame(conn)
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = _client(path)
        got: list[BaseException] = []

        def second_thread() -> None:
            try:
                client._conn()
            except BaseException as exc:
                got.append(exc)

        other = threading.Thread(target=second_thread)
        other.start()
        other.join(WAIT_S * 2)
        (exc,) = got
        assert isinstance(exc, ConnectionRefusedError), repr(exc)
        assert "too many" in str(exc)
    finally:
        thread.join(10)
        for conn in held:
            conn.close()
        listener.close()
