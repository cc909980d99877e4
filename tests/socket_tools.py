"""Raw connections to the server's unix socket, for tests that speak its
frames themselves (pegaflow.common.socket_frames)."""

from __future__ import annotations

import socket

from pegaflow.common.socket_frames import HELLO_REPLY, encode_hello


def greeted(path: str) -> socket.socket:
    """A connection to the socket at `path` whose hello the server accepted."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(encode_hello())
    assert sock.recv(HELLO_REPLY.size, socket.MSG_WAITALL)[0] == 0
    return sock
