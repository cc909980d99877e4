"""Adopting a pool file of servers before 2026-12-05 (a regular file of format 2
at --pool-file PATH): its bytes are copied into a new sealed memfd, then a
keeper's socket is renamed over PATH, once. A regular file that is no pool is
never overwritten; one of another geometry or format is refused or started
afresh as --pool-on-mismatch says.

The copy runs from the end of the file to its start and gives each copied chunk
of the old file back (a punched hole), so the adoption needs one chunk of
memory beyond the pool, not a second pool. Before the data is copied, rows the
old file holds as LANDED (trusted without a checksum) are marked WRITING in it:
a crash midway leaves the old file with SEALED rows whose punched bytes fail
their checksum and torn rows, so a restart that adopts it again loses blocks
but never serves wrong bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Callable

from tqdm import tqdm

from pegaflow.common.private_files import check_private, open_private

from .pool_claim import FLAG, PoolFileError

logger = logging.getLogger(__name__)

CHUNK = 64 << 20  # a multiple of 2 MiB: the copy's step, and its extra memory
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def open_old(path: str) -> int:
    """The old pool file, checked private and locked against an older server."""
    try:
        fd = open_private(path, os.O_RDWR, FLAG, PoolFileError)
    except OSError as exc:
        raise PoolFileError(f"{FLAG}: cannot open {path}: {exc}") from exc
    try:
        check_private(fd, path, FLAG, PoolFileError)
        _lock(fd, path)  # a server of an older version may still run on it
    except BaseException:
        os.close(fd)
        raise
    return fd


def copy_old(
    src: int, dst: int, head: int, total: int, tear: Callable[[int], None]
) -> None:
    """The old file's bytes into the memfd dst: the head (superblock, rows:
    [0, head)) first, then tear(src) marks its LANDED rows WRITING, then the
    data region back to front, each chunk punched out of src once copied."""
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="adopting pool",
        disable=None,  # a terminal only
    )
    _chunk(src, dst, 0, head)
    bar.update(head)
    tear(src)
    punch = _puncher()
    end = total
    while end > head:
        off = max(head, end - CHUNK)
        _chunk(src, dst, off, end - off)
        punch(src, off, end - off)
        bar.update(end - off)
        end = off
    bar.close()


def _chunk(src: int, dst: int, off: int, n: int) -> None:
    """Bytes [off, off+n) of src into dst, through a mapping of dst (a hugetlb
    memfd takes no write(2)); its pages allocated first, so a lack of memory
    is an error here, not a SIGBUS."""
    try:
        os.posix_fallocate(dst, off, n)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        raise PoolFileError(
            f"{FLAG}: no memory to adopt the old pool file ({exc}); free some, "
            "or remove the file to start an empty pool"
        ) from exc
    with mmap.mmap(dst, n, offset=off) as m:
        view = memoryview(m)
        done = 0
        while done < n:
            got = os.preadv(src, [view[done:]], off + done)
            if got <= 0:
                raise PoolFileError(f"{FLAG}: the old pool file ended at {off + done}")
            done += got
        view.release()


def _puncher() -> Callable[[int, int, int], None]:
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = libc.fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    warned: list[bool] = []

    def punch(fd: int, off: int, n: int) -> None:
        if fallocate(fd, _PUNCH, off, n) != 0 and not warned:
            warned.append(True)  # correct all the same, with twice the memory
            logger.warning(
                "%s: cannot give the old file's pages back as they are copied "
                "(%s); the adoption holds the pool twice until it ends",
                FLAG,
                os.strerror(ctypes.get_errno()),
            )

    return punch


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _flock_holder(fd)
        owner = f" (pid {holder})" if holder else ""
        raise PoolFileError(
            f"{FLAG}: {path} is locked by another process{owner}; two servers "
            "cannot share one pool file: stop it, or give this one its own path"
        ) from None


def _flock_holder(fd: int) -> int:
    """The pid holding a flock on the file, from the kernel's /proc/locks (the
    superblock's pid is only the last server's); 0 when it cannot be told."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError, ValueError), open("/proc/locks") as locks:
        for line in locks:
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == inode:
                return int(parts[4])
    return 0
