"""The pool keeper: a small detached process that holds a --pool-file pool's
memfd, so that the pool outlives the server and nobody can cut it short.

The pool's bytes live in a memfd sealed against shrinking and growing
(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): no `truncate`, by its owner or by
root, through /proc/PID/fd or otherwise, can take a page from under a running
server (a regular file could be: the next touch was a SIGBUS). A memfd has no
name in any filesystem, so a process must hold it: this one, at the unix socket
PATH (mode 0600). It hands the memfd over SCM_RIGHTS to one client at a time,
of its own uid (SO_PEERCRED); while that client's connection is open the next
is told "HELD <pid>". It exits, dropping the memfd, once PATH is unlinked or
names another inode: `rm PATH` frees the pool (once no server maps it).

Run as `python -m pegaflow.cache.pool_keeper PATH FD` with the memfd at FD (the
client side, pegaflow.cache.pool_claim, starts it): it forks the keeper proper
(setsid, stdio on /dev/null, cwd /), which binds a temporary name beside PATH
and renames it over PATH; the launcher then exits 0, or 2 with one line on
stderr. Standard library only (pegaflow.common.memfd is too): it keeps none of
the server's state (gRPC, CUDA, the pool's mapping).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import socket
import stat
import struct
import sys

from pegaflow.common.memfd import sealed

# Frames (SOCK_SEQPACKET: one message each). Keeper to client: OK with the
# memfd; HELD <pid>; UID <uid> (refused). Client to keeper: SWAP with a new
# memfd (another geometry) -> OK, or NO <why>.
OK, HELD, UID, SWAP, NO = b"OK", b"HELD", b"UID", b"SWAP", b"NO"
NAME = b"pegaflow-keeper"  # /proc/PID/comm: `pgrep pegaflow-keeper`
WATCH_S = 1.0  # how often PATH is stat'ed: a cheap call a second, no busy loop
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer(conn: socket.socket) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end, as the kernel says."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, _ = _PEERCRED.unpack(raw)
    return pid, uid


def inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


# sun_path holds 108 bytes with the NUL; _bind's temporary name adds up to 16.
MAX_PATH_BYTES = 107 - 16


def check_socket_path(path: str) -> None:
    """OSError where a keeper could not bind its socket at PATH."""
    if (n := len(os.fsencode(path))) > MAX_PATH_BYTES:
        raise OSError(
            f"the path is too long for the keeper's unix socket ({n} B, at "
            f"most {MAX_PATH_BYTES})"
        )


def _bind(path: str) -> socket.socket:
    """A listening socket at PATH, mode 0600 from its creation: bound at a
    temporary name in the same directory and renamed over PATH, so a
    connecting client finds either the old inode or this one."""
    check_socket_path(path)
    tmp = f"{path}.{os.getpid()}.keeper"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover of a keeper of this pid that died
        sock.bind(tmp)
        sock.listen(8)
        os.rename(tmp, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.umask(old)
    return sock


class Keeper:
    """The serve loop: one listener, at most one holder."""

    def __init__(self, sock: socket.socket, fd: int, path: str) -> None:
        self.sock, self.fd, self.path = sock, fd, path
        self.ino = inode(path)
        self.holder: socket.socket | None = None
        self.holder_pid = 0
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ)

    def run(self) -> None:
        while inode(self.path) == self.ino:
            for key, _ in self.sel.select(WATCH_S):
                try:
                    if key.fileobj is self.sock:
                        self._accept()
                    else:
                        self._from_holder()
                except OSError:  # one client's trouble, never the keeper's
                    if key.fileobj is self.holder:
                        self._drop()

    def _accept(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(5.0)  # a client that never reads costs 5 s at most
        pid, uid = peer(conn)
        if uid != os.geteuid():
            with conn:
                conn.send(UID + b" %d" % uid)
        elif self.holder is not None:
            with conn:
                conn.send(HELD + b" %d" % self.holder_pid)
        else:
            socket.send_fds(conn, [OK], [self.fd])
            self.holder, self.holder_pid = conn, pid
            self.sel.register(conn, selectors.EVENT_READ)

    def _from_holder(self) -> None:
        assert self.holder is not None
        msg, fds, _, _ = socket.recv_fds(self.holder, 64, 1)
        if not msg:  # the server stopped or died: the next may claim the pool
            for fd in fds:
                os.close(fd)
            self._drop()
            return
        if msg != SWAP or len(fds) != 1 or not sealed(fds[0]):
            for fd in fds:
                os.close(fd)
            self.holder.send(NO + b" a SWAP takes one sealed memfd")
            return
        os.close(self.fd)  # the old pool: freed once its server unmaps it
        self.fd = fds[0]
        self.holder.send(OK)

    def _drop(self) -> None:
        if self.holder is not None:
            self.sel.unregister(self.holder)
            self.holder.close()
            self.holder, self.holder_pid = None, 0


def _detach() -> None:
    """The keeper proper: its own session (no terminal's signals), stdio on
    /dev/null, cwd /, named in ps."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    os.close(null)
    os.chdir("/")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, NAME, 0, 0, 0)  # PR_SET_NAME


def main(argv: list[str]) -> int:
    """The launcher forks the keeper and exits once it listens (0) or failed
    (2, its reason on stderr): init reaps the keeper, and the socket's
    SO_PEERCRED names the keeper (listen() records the caller's pid)."""
    try:
        path, fd = argv[0], int(argv[1])
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not sealed(fd):
            raise OSError(f"descriptor {fd} is not a sealed memfd")
    except (OSError, ValueError, IndexError) as exc:
        print(f"pool keeper: {exc}", file=sys.stderr)
        return 2
    r, w = os.pipe()
    if os.fork():
        os.close(w)
        with os.fdopen(r, "rb") as word:
            why = word.read().decode(errors="replace")
        if why:
            print(f"{path}: {why}", file=sys.stderr)
        return 2 if why else 0
    os.close(r)
    try:
        sock = _bind(path)
    except OSError as exc:
        os.write(w, str(exc).encode())
        os._exit(2)
    _detach()
    os.close(w)  # EOF: the launcher exits 0, the socket listens
    Keeper(sock, fd, path).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
