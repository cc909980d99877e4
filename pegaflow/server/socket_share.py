"""The share exchange of the server's unix socket (pegaflow.common.share_frames):
a registered host engine hands over the sealed memfd behind its KV memory,
which the worker's copier maps (pegaflow.copiers.host_copier.share).

Who may: the registration's owner (its token, and the kernel's pid of this
connection, as for every request), and only the process whose memory the
registration names: SO_PEERCRED's pid must be that process's. The descriptor
is read with recvmsg from a dup of the connection's socket while the
connection's transport does not read (its recv would drop the descriptor);
anything but exactly one descriptor after READY ends the connection, as its
bytes no longer line up with frames.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pegaflow.common import deadlines
from pegaflow.common.errors import (
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    PegaflowError,
    PermissionDenied,
    UnknownInstance,
)
from pegaflow.common.identity import Caller
from pegaflow.common.share_frames import (
    DONE,
    READY,
    SHARE_DONE,
    SHARE_READY,
    decode_share,
)

from .copy_dispatch import uncancellable

if TYPE_CHECKING:
    from .engine import Engine

# How long a share waits for its descriptor after READY (the request's
# deadline, if sooner): the engine sends it at once.
FD_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class FdLost:
    """The descriptor did not come as it should: refuse and close."""

    error: PegaflowError


async def share(
    engine: Engine,
    caller: Caller,
    body: bytes,
    transport: asyncio.Transport,
    pause: Callable[[bool], None],
) -> bytes | FdLost:
    """Check the share, answer READY, read the descriptor, map it (off the
    loop: reading the engine's maps, mapping, compiling the copy loop once)."""
    req = decode_share(body)
    deadline = deadlines.from_wire(req.deadline_ns)
    deadlines.check(deadline, "share")
    registry = engine.registry
    worker = registry.owned_worker(req.instance_id, req.tp_rank, caller, req.token)
    map_it = getattr(worker.copier, "share", None)
    pid = getattr(worker.handle, "pid", None)
    if map_it is None or pid is None:
        raise InvalidRequest(
            f"share: {req.instance_id!r} rank {req.tp_rank} registered no host memory"
        )
    if caller.pid != pid:  # the memory's own process, as the kernel says
        raise PermissionDenied(
            f"share: the memory of {req.instance_id!r} rank {req.tp_rank} is "
            f"process {pid}'s, not the caller's (pid {caller.pid})"
        )
    sock = _reader(transport)  # before READY: a plain error, the stream intact
    try:
        fd = await receive_fd(sock, transport, deadline, pause)
    except PegaflowError as exc:
        return FdLost(exc)
    # Its memory stays open (not closed under the mapping being made) until
    # the share ends, as for a copy.
    worker.active_ops += 1
    try:
        if worker.closed or not registry.is_current(worker):
            raise UnknownInstance(
                f"instance_id: {req.instance_id!r} rank {req.tp_rank} is no "
                "longer registered"
            )
        signals = worker.signals  # the memfd may hold its words too
        work = asyncio.to_thread(map_it, worker.handle, fd, req.spans, signals)
        nbytes = await uncancellable(work)
    finally:
        registry.finish_op(worker)
        os.close(fd)  # the mapping keeps the file
    return SHARE_DONE.pack(0, DONE, nbytes)


def _reader(transport: asyncio.Transport) -> socket.socket:
    """A dup of the connection's socket, for recvmsg."""
    raw = transport.get_extra_info("socket")
    try:
        fd = os.dup(raw.fileno())
    except OSError as exc:  # EMFILE: the server's descriptors are all in use
        raise Overloaded(
            f"share.fd: the server cannot take a descriptor now ({exc.strerror}); "
            "the memory stays on process_vm"
        ) from None
    try:
        sock = socket.socket(fileno=fd)
    except BaseException:
        os.close(fd)
        raise
    sock.setblocking(False)
    return sock


async def receive_fd(
    sock: socket.socket,
    transport: asyncio.Transport,
    deadline: float | None,
    pause: Callable[[bool], None],
) -> int:
    """The one descriptor the engine sends with one byte after READY, read
    from `sock` (_reader's, closed here)."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future = loop.create_future()

    def readable() -> None:
        if got.done():
            return
        try:
            got.set_result(socket.recv_fds(sock, 1, 4))
        except BlockingIOError:
            return
        except OSError as exc:
            got.set_exception(exc)

    wait_s = FD_WAIT_S
    if deadline is not None:
        wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
    try:
        pause(True)
        transport.write(SHARE_READY.pack(0, READY))
        loop.add_reader(sock.fileno(), readable)
        data, fds, flags, _ = await asyncio.wait_for(got, wait_s)
    except TimeoutError:
        # It may have come in the pass that timed out: not left open.
        if got.done() and not got.cancelled() and got.exception() is None:
            for fd in got.result()[1]:
                os.close(fd)
        raise DeadlineExceeded(
            f"share.fd: none arrived within {wait_s:.1f} s of READY"
        ) from None
    except OSError as exc:
        raise InvalidRequest(f"share.fd: cannot read it ({exc})") from None
    finally:
        loop.remove_reader(sock.fileno())
        sock.close()
    truncated = bool(flags & socket.MSG_CTRUNC)
    if not data or len(fds) != 1 or truncated:
        for fd in fds:
            os.close(fd)
        raise InvalidRequest(
            "share.fd: need exactly one descriptor with the byte after READY, got "
            f"{len(fds)}{' (and more, dropped)' if truncated else ''}"
        )
    pause(False)
    return fds[0]
