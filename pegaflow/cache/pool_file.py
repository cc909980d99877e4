"""The L1 pool in a file that outlives the server (--pool-file): /dev/shm, or a
hugetlbfs mount with --use-hugepages.

Layout: a superblock (format version and geometry), a slot header table (one
row per 4 KiB granule of the data region: the row of a slot is the granule its
first byte lies in, so slots of at least a granule never share a row), then the
data region itself, aligned to the page size. What the rows say, and when, is
pegaflow.cache.slot_log's; what a restarted server rebuilds from them is
pegaflow.server.warm_restart's.

One server per file: an exclusive flock, held while the mapping lives.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np

from pegaflow.common.private_files import check_private, open_private
from pegaflow.common.settings import OnMismatch

logger = logging.getLogger(__name__)


MAGIC = b"PEGAPOOL"
# The slot checksum's algorithm is part of the format (pegaflow.cache.slot_log): a
# file of another version is never read, only refused or reinitialised.
VERSION = 2
FORMATS = {1: "blake3 slot checksums", 2: "xxh3-64 slot checksums"}
GRANULE = 4096  # data bytes per header row; smaller slots are not recorded
# magic, version, row bytes, granule, data bytes, slab bytes, data offset, pid
_SUPER = struct.Struct("<8sIIIQQQI")
SUPER_BYTES = 4096

FREE, WRITING, LANDED, SEALED = 0, 1, 2, 3
# state, gen and checksum first: the checksum covers the rest of the row
# (pegaflow.cache.slot_log.META) and the slot's bytes.
_FIELDS = np.dtype(
    [
        ("state", "<u4"),
        ("gen", "<u4"),
        ("checksum", "<u8"),
        ("offset", "<u8"),  # of the slot in the data region
        ("slot_bytes", "<u8"),
        ("digest", "u1", (16,)),  # namespace name + geometry (gds namespace_digest)
        ("hash", "u1", (64,)),
        ("hash_len", "u1"),
        ("shard", "<u2"),
        ("shards", "<u2"),
        ("num_layers", "<u2"),
    ],
    align=True,
)
ROW_BYTES = 128
META_OFFSET = 16  # the checksum covers the row from here on, and the slot
ROW = np.dtype(
    {
        "names": _FIELDS.names,
        "formats": [_FIELDS.fields[n][0] for n in _FIELDS.names],
        "offsets": [_FIELDS.fields[n][1] for n in _FIELDS.names],
        "itemsize": ROW_BYTES,
    }
)


class PoolFileError(RuntimeError):
    """--pool-file cannot be used; the message names the flag and the fix."""


@dataclass(frozen=True, slots=True)
class Geometry:
    data_bytes: int
    slab_bytes: int
    align: int  # 4 KiB, or 2 MiB on hugetlbfs

    @property
    def rows(self) -> int:
        return self.data_bytes // GRANULE

    @property
    def data_offset(self) -> int:
        head = SUPER_BYTES + self.rows * ROW_BYTES
        return -(-head // self.align) * self.align

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.data_bytes


class PoolFile:
    """The open, locked, mapped file. `fresh`: its rows are all FREE (a new or
    reinitialised file); otherwise they are what the last server left."""

    def __init__(self, path: str, geometry: Geometry, on_mismatch: OnMismatch) -> None:
        self.path = path
        self.geometry = geometry
        self.fd = _open_locked(path)
        try:
            self.fresh = self._check_or_init(on_mismatch)
            self.mmap = mmap.mmap(
                self.fd,
                geometry.file_bytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except BaseException:
            os.close(self.fd)
            raise
        self.table = np.ndarray(
            geometry.rows, ROW, buffer=self.mmap, offset=SUPER_BYTES
        )
        self.data = np.ndarray(
            geometry.data_bytes, np.uint8, self.mmap, geometry.data_offset
        )

    def _check_or_init(self, on_mismatch: OnMismatch) -> bool:
        g = self.geometry
        size = os.fstat(self.fd).st_size
        found = _read_super(self.fd)
        want = (VERSION, ROW_BYTES, GRANULE, g.data_bytes, g.slab_bytes, g.data_offset)
        if found == want and size == g.file_bytes:
            self._write_super()  # this server's pid, for a second one's message
            return False
        if found == want:  # ours, cut short (or grown) since
            why = (
                f"it is truncated to {size} B (or grown: this pool needs "
                f"{g.file_bytes} B)"
            )
        elif found is not None:
            version, _, _, data, slab, _ = found
            why = (
                f"it holds a pool of format {_format(version)}, {data} B in slabs "
                f"of {slab} B; this server needs format {_format(VERSION)}, "
                f"{g.data_bytes} B in slabs of {g.slab_bytes} B"
            )
        elif size == 0:
            why = ""
        elif _magic_cut(self.fd, size):
            why = f"it is truncated to {size} B, inside its superblock"
        else:  # never overwritten, whatever --pool-on-mismatch says
            raise PoolFileError(
                f"--pool-file: {self.path} is not a pool file ({size} B, no "
                "PEGAPOOL superblock); name a new file or an old pool file"
            )
        if why and on_mismatch == "refuse":
            raise PoolFileError(
                f"--pool-file: {self.path}: {why}; start with the same --pool-size "
                "(and a server of that format), pass --pool-on-mismatch reinit "
                "to start it afresh, or name another file"
            )
        if why:
            logger.warning("pool file %s: %s; reinitialising it", self.path, why)
        self._init()
        return True

    def _init(self) -> None:
        os.ftruncate(self.fd, 0)  # drops the old pages: rows read FREE (zero)
        try:
            os.posix_fallocate(self.fd, 0, self.geometry.file_bytes)
        except OSError as exc:
            os.ftruncate(self.fd, 0)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                free = os.statvfs(self.path)
                raise PoolFileError(
                    f"--pool-file: {self.path}: no room for "
                    f"{self.geometry.file_bytes / (1 << 30):.2f} GiB there "
                    f"({free.f_bavail * free.f_frsize / (1 << 30):.2f} GiB free); "
                    "pass a smaller --pool-size or put the file elsewhere"
                ) from exc
            raise
        self._write_super()

    def _write_super(self) -> None:
        g = self.geometry
        head = _SUPER.pack(
            MAGIC,
            VERSION,
            ROW_BYTES,
            GRANULE,
            g.data_bytes,
            g.slab_bytes,
            g.data_offset,
            os.getpid(),
        )
        os.pwrite(self.fd, head, 0)

    def close(self) -> None:
        """Unmaps and unlocks; the file and its bytes stay for the next server."""
        if self.fd < 0:
            return
        del self.table, self.data
        try:
            self.mmap.close()
        except BufferError:  # a view is still alive; the OS unmaps it at exit
            logger.debug("pool file mapping still referenced at close")
        os.close(self.fd)
        self.fd = -1


FLAG = "--pool-file"


def _format(version: int) -> str:
    name = FORMATS.get(version)
    return f"{version} ({name})" if name else str(version)


def _open_locked(path: str) -> int:
    try:
        fd = open_private(path, os.O_RDWR | os.O_CREAT, FLAG, PoolFileError)
    except OSError as exc:
        raise PoolFileError(f"{FLAG}: cannot open {path}: {exc}") from exc
    try:
        exposed = stat.S_IMODE(os.fstat(fd).st_mode) & 0o044
        check_private(fd, path, FLAG, PoolFileError)
    except PoolFileError:
        os.close(fd)
        raise
    fd = _lock(fd, path)
    if exposed:
        fd = _replace(fd, path)
    return fd


def _replace(fd: int, path: str) -> int:
    """A file others could read: whoever opened or mapped it then keeps
    reading that file (its inode) whatever its mode says now, so every later
    tenant's blocks would reach them. The pool starts on a new private file
    at the path instead; the old one's blocks are dropped with it."""
    logger.warning(
        "%s: %s was readable by other users: a process that opened or mapped "
        "it would keep reading it; starting on a new private file (its cached "
        "blocks are dropped)",
        FLAG,
        path,
    )
    fresh_path = f"{path}.{os.getpid()}.new"
    try:
        fresh = open_private(
            fresh_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FLAG, PoolFileError
        )
    except OSError as exc:
        os.close(fd)
        raise PoolFileError(f"{FLAG}: cannot create {fresh_path}: {exc}") from exc
    try:
        fresh = _lock(fresh, fresh_path)
        os.rename(fresh_path, path)
    except BaseException:
        with contextlib.suppress(OSError):  # _lock closed it already, if it failed
            os.close(fresh)
        with contextlib.suppress(OSError):
            os.unlink(fresh_path)
        raise
    finally:
        os.close(fd)
    return fresh


def _lock(fd: int, path: str) -> int:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _flock_holder(fd)
        os.close(fd)
        owner = f" (pid {holder})" if holder else ""
        raise PoolFileError(
            f"--pool-file: {path} is locked by another process{owner}; two "
            "servers cannot share one pool file: stop it, or give this one its "
            "own file"
        ) from None
    return fd


def _flock_holder(fd: int) -> int:
    """The pid holding a flock on the file, from the kernel's /proc/locks (the
    superblock's pid is only the last server's: another process, even
    another user's, may hold the lock); 0 when it cannot be told."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == inode:
                    return int(parts[4])
    except (OSError, ValueError):
        pass
    return 0


def _has_super(fd: int) -> bool:
    return os.fstat(fd).st_size >= _SUPER.size


def _magic_cut(fd: int, size: int) -> bool:
    """A file shorter than a superblock that starts as one: a pool file cut
    inside its first page, not somebody else's file."""
    head = os.pread(fd, min(size, len(MAGIC)), 0)
    return 0 < size < _SUPER.size and head == MAGIC[: len(head)] and len(head) >= 4


def _read_super(fd: int) -> tuple[int, int, int, int, int, int] | None:
    if not _has_super(fd):
        return None
    magic, version, row_bytes, granule, data, slab, offset, _ = _SUPER.unpack(
        os.pread(fd, _SUPER.size, 0)
    )
    if magic != MAGIC:
        return None
    return version, row_bytes, granule, data, slab, offset
