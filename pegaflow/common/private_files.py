"""Files that hold every tenant's KV bytes (the pool file, the SSD tier's
data files and journal): created with mode 0600, opened only as a regular
file of the server's user with one link, never through a symbolic link.

Read bits for others on a file of ours (the SSD files of versions before
2026-12-02 were created 0644) are taken away with a warning: nobody could
have changed the file through them. Write bits for others, another owner, a
second link or a link on the path refuse the start with a message naming
the flag and the fix.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

logger = logging.getLogger(__name__)


def open_private(path: str, flags: int, flag: str, error: type[Exception]) -> int:
    """os.open of a regular file, never following a symbolic link at `path` (a
    new file gets mode 0600). Raises `error` naming `flag` for a link or a
    non-regular file; OSError for the rest (FileNotFoundError without
    O_CREAT)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(
                f"{flag}: {path} is a symbolic link; name the file itself"
            ) from exc
        if exc.errno == errno.EISDIR:
            raise error(f"{flag}: {path} is not a regular file") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{flag}: {path} is not a regular file")
    return fd


def check_private(fd: int, path: str, flag: str, error: type[Exception]) -> None:
    """Raise `error` unless only this server's user can change the file open
    at fd and no other name reaches it; others' read bits are removed."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise error(
            f"{flag}: {path} belongs to uid {st.st_uid}, not this server's user "
            f"({os.geteuid()}); remove it, or run as its owner"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise error(
            f"{flag}: {path} has mode {mode:o}; other users could change the "
            f"cache: chmod 600 {path} (or remove it)"
        )
    if st.st_nlink != 1:
        raise error(
            f"{flag}: {path} has {st.st_nlink} hard links; give the server a "
            "file of its own"
        )
    if mode & 0o077:
        os.fchmod(fd, mode & 0o700)
        logger.warning("%s: %s was mode %o; now %o", flag, path, mode, mode & 0o700)
