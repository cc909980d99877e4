"""The server's side of the pool keeper (pegaflow.cache.pool_keeper): make a
sealed memfd, start a keeper for it, claim the pool from a keeper, hand it a
memfd of another geometry, and re-seed a keeper that died while the server
still maps the pool (so the pool survives any single process's death).

Everything received is checked before it is used: the socket is this user's,
the keeper is this user's (SO_PEERCRED), the descriptor a memfd carrying the
shrink, grow and seal seals. A failure is PoolFileError naming --pool-file
and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from pegaflow.common.memfd import SEALS, sealed

from .pool_keeper import HELD, OK, SWAP, UID, inode, peer

logger = logging.getLogger(__name__)

FLAG = "--pool-file"
HUGE_ALIGN = 2 << 20  # a geometry aligned to 2 MiB pages: --use-hugepages


class PoolFileError(RuntimeError):
    """--pool-file cannot be used; the message names the flag and the fix."""


class PoolHeld(PoolFileError):
    """The keeper answered that another connection holds its pool."""


# A keeper this server just started may be held for an instant by a probe
# (an operator's tool, a test asking which pid listens): publish waits this
# long for it. Giving up at once left a reseeded pool with no keeper at all
# (seen in CI: the probe won the race about once in a few hundred runs).
HELD_RETRY_S = 5.0
HELD_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class Claim:
    """The pool as a keeper handed it over: hold `sock` open to keep it."""

    sock: socket.socket
    fd: int
    keeper_pid: int
    ino: tuple[int, int] | None  # PATH's inode when claimed


def new_memfd(size: int, align: int, allocate: bool = True) -> int:
    """A memfd of `size` bytes sealed at that size, its pages allocated (or,
    allocate=False, to be allocated by the caller: an adoption's copy)."""
    flags = os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC
    if align >= HUGE_ALIGN:
        flags |= os.MFD_HUGETLB
    try:
        fd = os.memfd_create("pegaflow-pool", flags)
    except OSError as exc:
        raise PoolFileError(f"{FLAG}: cannot create the pool's memfd: {exc}") from exc
    try:
        os.ftruncate(fd, size)
        if allocate:
            os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        what = "free 2 MiB hugepages" if align >= HUGE_ALIGN else "memory"
        raise PoolFileError(
            f"{FLAG}: no room for {size >> 20} MiB of {what}; pass a "
            "smaller --pool-size (or reserve more hugepages)"
        ) from exc
    return fd


def check_socket(path: str, st: os.stat_result) -> None:
    """A socket at PATH that another user made is never used or removed: its
    keeper would be theirs, and the pool it hands over theirs to read."""
    if st.st_uid != os.geteuid():
        raise PoolFileError(
            f"{FLAG}: {path} is a socket of uid {st.st_uid}, not this server's "
            f"user ({os.geteuid()}); another user may be squatting the path: "
            "remove it (as root or its owner) or name another path"
        )


def start_keeper(path: str, fd: int) -> None:
    """A keeper for the memfd at fd, listening at PATH once this returns."""
    import pegaflow

    root = os.path.dirname(os.path.dirname(os.path.abspath(pegaflow.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "pegaflow.cache.pool_keeper", path, str(fd)]
    try:
        done = subprocess.run(
            argv,
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PoolFileError(f"{FLAG}: cannot start the pool keeper: {exc}") from exc
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        raise PoolFileError(
            f"{FLAG}: cannot keep the pool at {path} ({why}); name a path on a "
            "local filesystem where this user may create a unix socket, e.g. "
            "under /dev/shm"
        )


def claim(path: str) -> Claim | None:
    """The pool from the keeper at PATH; None when no keeper listens there (a
    stale socket, left by a keeper that was killed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(30.0)
    try:
        ino = inode(path)
        sock.connect(path)
        keeper_pid, uid = peer(sock)
        if uid != os.geteuid():
            raise PoolFileError(
                f"{FLAG}: the keeper at {path} (pid {keeper_pid}) runs as uid "
                f"{uid}, not this server's user; remove {path} or name another path"
            )
        msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    except PoolFileError:
        sock.close()
        raise
    except OSError as exc:
        sock.close()
        why = f"{FLAG}: cannot reach the keeper at {path}: {exc}"
        raise PoolFileError(why) from exc
    if msg == OK and len(fds) == 1:
        return _checked(Claim(sock, fds[0], keeper_pid, ino), path)
    for fd in fds:
        os.close(fd)
    sock.close()
    word, _, arg = msg.partition(b" ")
    if word == HELD:
        raise PoolHeld(
            f"{FLAG}: the pool at {path} is held by pid {arg.decode()}; two "
            "servers cannot share one pool: stop it, or give this one its own path"
        )
    if word == UID:
        raise PoolFileError(f"{FLAG}: the keeper at {path} refused uid {arg.decode()}")
    raise PoolFileError(f"{FLAG}: the keeper at {path} answered {msg[:40]!r}")


def _checked(c: Claim, path: str) -> Claim:
    if not sealed(c.fd):
        os.close(c.fd)
        c.sock.close()
        raise PoolFileError(
            f"{FLAG}: the keeper at {path} (pid {c.keeper_pid}) handed over "
            f"something other than a sealed memfd; remove {path} and start again"
        )
    return c


def swap(c: Claim, fd: int, path: str) -> None:
    """The keeper holds `fd` (a pool of another geometry) from now on."""
    try:
        socket.send_fds(c.sock, [SWAP], [fd])
        answer = c.sock.recv(64)
    except OSError as exc:
        raise PoolFileError(f"{FLAG}: the keeper at {path}: {exc}") from exc
    if answer != OK:
        raise PoolFileError(f"{FLAG}: the keeper at {path} refused: {answer!r}")


def same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def publish(path: str, fd: int) -> Claim:
    """Start a keeper for fd at PATH and claim the pool from it: it must be
    fd's own memfd (not a pool another server's keeper put there meanwhile)."""
    start_keeper(path, fd)
    waited = 0.0
    while True:
        try:
            c = claim(path)
            break
        except PoolHeld:
            if waited >= HELD_RETRY_S:
                raise
            time.sleep(HELD_POLL_S)
            waited += HELD_POLL_S
    if c is None or not same_file(c.fd, fd):
        if c is not None:
            os.close(c.fd)
            c.sock.close()
        raise PoolFileError(
            f"{FLAG}: another process replaced the keeper at {path} as this one "
            "started; is another server starting on it? Give each its own path"
        )
    os.close(c.fd)  # the caller's fd is the same memfd
    return Claim(c.sock, fd, c.keeper_pid, c.ino)


class Watch:
    """Holds the claim while the server runs. A keeper that dies (SIGKILL)
    closes the connection while PATH still names its socket: a new keeper is
    seeded with the memfd this server maps. PATH removed or replaced: the
    operator freed the pool; it goes when this server exits."""

    def __init__(self, c: Claim, path: str, fd: int) -> None:
        self.claim, self.path, self.fd = c, path, fd
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="pegaflow-keeper-watch", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._closing.is_set():
            with contextlib.suppress(OSError):
                self.claim.sock.settimeout(None)
                if self.claim.sock.recv(64):
                    continue  # nothing is sent unasked; ignore
            if self._closing.is_set():
                return
            if inode(self.path) != self.claim.ino:
                logger.warning(
                    "%s: %s was removed or replaced: this pool is freed when "
                    "this server exits",
                    FLAG,
                    self.path,
                )
                return
            self._reseed()

    def _reseed(self) -> None:
        dead = self.claim.keeper_pid
        try:  # the new keeper's socket is renamed over the dead one's
            self.claim = publish(self.path, self.fd)
        except PoolFileError as exc:
            logger.error("%s: pool keeper %d died; no new one: %s", FLAG, dead, exc)
            self._closing.set()
            return
        logger.warning(
            "%s: pool keeper %d died; keeper %d holds the pool now",
            FLAG,
            dead,
            self.claim.keeper_pid,
        )

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self.claim.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)
        self.claim.sock.close()
