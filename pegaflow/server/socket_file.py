"""The fast path's unix socket file: created private, never clobbering.

`bind_private_unix` binds with the umask at 0o177, so the socket inode is mode
0600 from the moment it exists: there is no window in which another user could
connect (a chmod after bind leaves one). The umask is process-wide; the server
binds on its event-loop thread during start-up, and the only other threads then
(the SSD tier's writers) create nothing else in that moment; were one to, its file
would come out more private, never less.

A path that is there already is left alone unless it is provably ours and dead: a
socket of our uid that refuses connections (its server died). Anything else (a
regular file, a directory, a symlink, another user's socket, a live server) is
refused with a message naming the flag. At stop `unlink_if_ours` removes the
path only if it is still the inode this process bound.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat

from pegaflow.daemon.startup import StartupError

logger = logging.getLogger(__name__)

BACKLOG = 128
_PROBE_TIMEOUT_S = 1.0
FileId = tuple[int, int]  # (st_dev, st_ino)

# Socket (its sockfs inode, from fstat) -> the file it was bound to. Keyed so
# that unlink_if_ours works from any wrapper with a fileno() (asyncio hands out
# TransportSocket views of the socket it was given).
_bound: dict[FileId, tuple[str, FileId]] = {}


def check_path(path: str, flag: str = "--socket") -> bool:
    """Refuse (StartupError) what bind_private_unix would refuse; True when a
    stale socket of ours sits there (bind removes it). Cheap: no bind."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise StartupError(
            f"{flag}: directory {parent} does not exist; create it, or pass "
            f"another path, 'auto' or 'off'"
        )
    if len(os.fsencode(path)) > 107:  # sun_path holds 108 bytes with the NUL
        raise StartupError(
            f"{flag}: {path} is longer than a unix socket path may be (107 "
            "bytes); pass a shorter path or 'auto'"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(
            f"{flag}: {path} exists and is {_kind(st.st_mode)}, not a socket; "
            "it is left alone: remove it yourself or pass another path"
        )
    if st.st_uid != os.geteuid():
        raise StartupError(
            f"{flag}: {path} is a socket of uid {st.st_uid}, not ours "
            f"({os.geteuid()}); pass another path"
        )
    if _listening(path, flag):
        raise StartupError(
            f"{flag}: another server is listening on {path}; stop it or pass "
            "another path"
        )
    return True


def bind_private_unix(path: str, flag: str = "--socket") -> socket.socket:
    """A bound, listening AF_UNIX socket at `path`, mode 0600 from the start."""
    if check_path(path, flag):
        logger.info("removing stale socket %s (its server is gone)", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)  # never replaces a file: EADDRINUSE if one appeared
        finally:
            os.umask(old)
        sock.listen(BACKLOG)
        st = os.lstat(path)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"{flag}: {path} appeared while starting; pass another path"
            ) from exc
        raise StartupError(
            f"{flag}: cannot create {path}: {exc.strerror or exc}"
        ) from exc
    _bound[_sock_id(sock)] = (path, (st.st_dev, st.st_ino))
    return sock


def unlink_if_ours(path: str, sock: socket.socket) -> bool:
    """Remove `path` if it is still the file `sock` was bound to (call it before
    closing `sock`). Someone else's file at the path is left alone."""
    try:
        bound = _bound.pop(_sock_id(sock), None)
    except OSError:  # closed already: we cannot tell which file was ours
        bound = None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if bound != (path, (st.st_dev, st.st_ino)):
        logger.warning("%s is no longer our socket; leaving it", path)
        return False
    os.unlink(path)
    return True


def _sock_id(sock: socket.socket) -> FileId:
    st = os.fstat(sock.fileno())
    return st.st_dev, st.st_ino


def _listening(path: str, flag: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return False
    except TimeoutError:  # a full backlog: someone is there, just busy
        return True
    except OSError as exc:
        raise StartupError(
            f"{flag}: cannot tell whether {path} is in use ({exc.strerror}); "
            "pass another path"
        ) from exc
    finally:
        probe.close()
    return True


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file"
