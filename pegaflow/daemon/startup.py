"""Start-up conditions the operator must fix, as one line naming the flag.

The CLI prints a StartupError's message and exits 2; it is an OSError so that
callers that already treat OS failures at start-up as fatal keep doing so.
"""

from __future__ import annotations

import errno
import socket


class StartupError(OSError):
    """The server cannot start as configured; the message names the flag and
    the fix (one argument: str() is the message, no errno prefix)."""


def bind_error(flag: str, addr: str, host: str, port: int) -> StartupError | None:
    """Why `host:port` cannot be listened on, or None when it can (right now).

    gRPC reports a failed bind as a bare 0 and the HTTP server as a bare errno;
    a probe with a plain socket tells which case it is, before the pool is up.
    """
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return StartupError(f"{flag}: cannot resolve {host!r} ({exc.strerror})")
    family, kind, proto, _, sockaddr = infos[0]
    probe = socket.socket(family, kind, proto)
    try:
        # As grpc and http.server do: a port in TIME_WAIT is free to take.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(sockaddr)
        probe.listen(1)
    except OSError as exc:
        return bind_failed(flag, addr, exc)
    finally:
        probe.close()
    return None


def bind_failed(flag: str, addr: str, exc: OSError) -> StartupError:
    """The one-line reason a bind of `addr` failed with `exc`."""
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"{flag}: {addr} is in use (another pegaflow-server?); stop that "
            f"process or pass a free port, e.g. {flag} {_host_of(addr)}:0"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(
            f"{flag}: {_host_of(addr)} is not an address of this machine; use "
            "127.0.0.1, 0.0.0.0 or the address of one of its interfaces"
        )
    if exc.errno == errno.EACCES:
        return StartupError(
            f"{flag}: {addr} needs privileges to bind; pass a port >= 1024"
        )
    return StartupError(f"{flag}: cannot listen on {addr}: {exc.strerror or exc}")


def _host_of(addr: str) -> str:
    return addr.rpartition(":")[0] or "127.0.0.1"
