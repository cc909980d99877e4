"""What the kernel says of a unix-socket connection's peer, asked without
blocking: whether it hung up, has bytes waiting, or (SO_PEERPIDFD) whether the
process that connected has exited."""

from __future__ import annotations

import errno
import os
import platform
import select
import socket

from pegaflow.common.errors import Overloaded, PermissionDenied
from pegaflow.common.pidfds import NO_DESCRIPTOR

# The kernel's handle on the process that connected (Linux 6.5+; the generic
# value, which x86_64 and aarch64 use); Python names it from 3.14 only.
SO_PEERPIDFD = getattr(
    socket,
    "SO_PEERPIDFD",
    77 if platform.machine() in ("x86_64", "aarch64") else None,
)


def hung_up(sock: object) -> bool:
    """Whether the peer closed its end (POLLHUP), not only its writing half
    (shutdown(SHUT_WR): it still reads the answers)."""
    try:
        poller = select.poll()
        poller.register(sock.fileno(), 0)  # POLLHUP is reported unasked
        return any(ev & select.POLLHUP for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # closed already: gone
        return True


def unread(sock: socket.socket | None) -> bool:
    """Whether bytes wait to be read on the connection."""
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return any(ev & select.POLLIN for _, ev in poller.poll(0))


def peer_exited(sock: socket.socket) -> bool:
    """Whether the process that opened the connection has exited, as the
    kernel tells by SO_PEERPIDFD; False where it cannot (before Linux 6.5:
    docs/security.md names the residual). Out of descriptors, or an answer
    not foreseen, refuses the registration rather than passing it unchecked."""
    if SO_PEERPIDFD is None:
        return False
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:  # before Linux 6.5
            return False
        if exc.errno in (errno.ESRCH, errno.EINVAL):  # reaped: no task left
            return True
        if exc.errno in NO_DESCRIPTOR:  # not a pass: refuse
            raise Overloaded(
                f"register: the server cannot take a descriptor now ({exc.strerror})"
            ) from None
        raise PermissionDenied(
            "register: the kernel did not tell whether the process that opened "
            f"this connection still runs ({exc.strerror})"
        ) from None
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # a pidfd reads once it exited
        return bool(poller.poll(0))
    finally:
        os.close(fd)
