"""Raw connections to the server's unix socket, for tests that speak its
frames themselves (pegaflow.common.socket_frames)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from pegaflow.common.socket_frames import HELLO_REPLY, encode_hello
from tests.procs import HOST_ONLY, ServerProc, start_server

# start_server runs the server under this prefix: argv is then the budget,
# python, -m, pegaflow.cli and the server's arguments.
_WITH_BUDGET = (
    "import sys; from pegaflow.server import socket_service; "
    "socket_service.BACKLOG_BUDGET = int(sys.argv[1]); "
    "from pegaflow.server.cli import main; raise SystemExit(main(sys.argv[5:]))"
)


def server_with_budget(tmp_path: Path, budget: int) -> ServerProc:
    """A real host-only server whose socket backlog budget is `budget` bytes
    (socket_service.BACKLOG_BUDGET, 256 MiB in a real one): a test fills it
    with a few MiB of unread replies instead of hundreds."""
    prefix = (sys.executable, "-c", _WITH_BUDGET, str(budget))
    return start_server(tmp_path, "--pool-size", "16mb", *HOST_ONLY, prefix=prefix)


def greeted(path: str) -> socket.socket:
    """A connection to the socket at `path` whose hello the server accepted."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(encode_hello())
    assert sock.recv(HELLO_REPLY.size, socket.MSG_WAITALL)[0] == 0
    return sock
