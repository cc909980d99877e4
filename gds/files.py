"""Start-up of the SSD tier's data files: check the paths, recognise files written
before, preallocate and stamp new ones.

Files that carry a superblock of this format version and capacity, all from one
store, are reused (their blocks survive the restart). Files of another version,
capacity or file set are reinitialised with a warning saying why, or refused
(`on_mismatch="refuse"`); so are files whose records name a checksum this
server does not know, found later by recovery (`Mismatch`, `reinitialise`). A
file that is not ours and holds data is never touched; one of ours that other
users could read or change, or that is reached through a symbolic link or a
second hard link, is refused (private.py). Each file stays locked (flock on its
own descriptor) while the store runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from dataclasses import dataclass

from .config import SsdConfig
from .format import (
    FILE_MAGIC,
    FORMAT_VERSION,
    INIT_MAGIC,
    STORE_ID_BYTES,
    SUPERBLOCK_BYTES,
    FormatError,
    Superblock,
)
from .io import SsdError
from .private import check_private, open_private

logger = logging.getLogger(__name__)
GiB = float(1 << 30)
DAMAGED = Superblock(-1, -1, -1, -1, b"", 0.0)  # magic right, checksum wrong


@dataclass(frozen=True, slots=True)
class Layout:
    store_id: bytes
    file_bytes: int
    fresh: bool  # initialised now: nothing to recover
    reason: str  # why the files were (re)initialised, "" when reused
    # One per data file, held (flock) until the store closes: one server per
    # cache file, whatever name or alias reaches it.
    fds: tuple[int, ...]


class Mismatch(Exception):
    """Files found, while rebuilding the index, not to fit this server; the
    message says why (refused or reinitialised by `reinitialise`)."""


def prepare(cfg: SsdConfig) -> Layout:
    fds: list[int] = []
    created: list[str] = []
    try:
        for path in cfg.paths:
            fd, new = _open(path)
            fds.append(fd)
            if new:
                created.append(path)
            _lock(fd, path)
        return _prepare(cfg, tuple(fds))
    except BaseException:
        for fd in fds:
            os.close(fd)
        for path in created:  # a start that failed leaves nothing behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise


def _open(path: str) -> tuple[int, bool]:
    """The data file open for reading and writing, and whether it was created
    now. Opening it tests what access bits cannot (they do not bind root): a
    read-only filesystem refuses."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise SsdError(f"ssd cache {path}: directory {parent} does not exist")
    try:
        return open_private(path, os.O_RDWR), False
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SsdError(
            f"ssd cache {path}: cannot open it for writing: {exc.strerror}"
        ) from exc
    try:
        return open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
    except OSError as exc:
        raise SsdError(
            f"ssd cache {path}: cannot create files in {parent}: {exc.strerror}"
        ) from exc


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SsdError(
            f"--ssd-cache-path: {path} is in use by another process (two servers "
            "cannot share cache files): stop it, or give this server its own files"
        ) from None


def _prepare(cfg: SsdConfig, fds: tuple[int, ...]) -> Layout:
    found = [
        _read_superblock(fd, path) for fd, path in zip(fds, cfg.paths, strict=True)
    ]
    for fd, path in zip(fds, cfg.paths, strict=True):
        # After the foreign check: a file that is not ours is named so, not
        # given advice to chmod it.
        check_private(fd, path)
    sizes = [os.fstat(fd).st_size for fd in fds]
    reason = _mismatch(cfg, found, sizes)
    if not reason:
        assert found[0] is not None
        return Layout(found[0].store_id, cfg.file_bytes, False, "", fds)
    existing = any(sb is not None for sb in found)
    return reinitialise(cfg, fds, reason, existing)


def reinitialise(
    cfg: SsdConfig, fds: tuple[int, ...], reason: str, existing: bool = True
) -> Layout:
    """Start the files afresh (a new store id, so nothing of theirs is read
    again), or refuse to where `on_mismatch="refuse"` and they hold a cache."""
    if existing and cfg.on_mismatch == "refuse":
        raise SsdError(
            f"ssd cache files do not match this server: {reason}; delete them or "
            "start with --ssd-on-mismatch reinit (drops the blocks cached there)"
        )
    if existing:
        logger.warning("ssd cache: reinitialising (%s); its blocks are dropped", reason)
    _check_space(cfg, fds)
    store_id = os.urandom(STORE_ID_BYTES)
    for i, (fd, path) in enumerate(zip(fds, cfg.paths, strict=True)):
        _create(
            fd,
            path,
            Superblock(
                FORMAT_VERSION, i, len(cfg.paths), cfg.file_bytes, store_id, time.time()
            ),
        )
    return Layout(store_id, cfg.file_bytes, True, reason, fds)


def _read_superblock(fd: int, path: str) -> Superblock | None:
    """The file's superblock; None for an empty file or one whose making a
    crash cut short (INIT_MAGIC). Raises SsdError for any other file without
    our superblock, its first page all zeros included."""
    raw = os.pread(fd, SUPERBLOCK_BYTES, 0)
    if not raw or raw.startswith(INIT_MAGIC):
        return None
    if not raw.startswith(FILE_MAGIC):
        zeros = " (its first 4 KiB are zeros)" if not raw.strip(b"\0") else ""
        raise SsdError(
            f"ssd cache {path}: exists and is not a PegaFlow SSD cache "
            f"file{zeros}; refusing to overwrite it (pick another path or "
            "delete it: the server makes its own)"
        )
    try:
        return Superblock.unpack(raw)
    except FormatError:  # ours, but its first page is damaged
        return DAMAGED


def _mismatch(cfg: SsdConfig, found: list[Superblock | None], sizes: list[int]) -> str:
    """Why the files cannot be reused as they are ("" when they can)."""
    if all(sb is None for sb in found):
        return "new files"
    for i, (path, sb, size) in enumerate(zip(cfg.paths, found, sizes, strict=True)):
        if sb is None:
            return f"{path} is new beside existing cache files"
        if sb is DAMAGED:
            return f"{path} has a damaged superblock"
        if sb.version != FORMAT_VERSION:
            return (
                f"{path} is of format version {sb.version}, this server writes "
                f"version {FORMAT_VERSION}"
            )
        if sb.file_bytes != cfg.file_bytes:
            return (
                f"capacity changed: {path} holds {sb.file_bytes / GiB:.2f} GiB, the "
                f"configuration asks for {cfg.file_bytes / GiB:.2f} GiB per file"
            )
        if size < sb.file_bytes:  # truncated: its records past the end are gone
            return f"{path} shrank to {size} bytes, its superblock says {sb.file_bytes}"
        if sb.file_count != len(cfg.paths) or sb.file_index != i:
            return (
                f"file set changed: {path} was file {sb.file_index + 1} of "
                f"{sb.file_count}, now {i + 1} of {len(cfg.paths)}"
            )
        if sb.store_id != found[0].store_id:  # type: ignore[union-attr]
            return f"{path} belongs to another cache than {cfg.paths[0]}"
    return ""


def _check_space(cfg: SsdConfig, fds: tuple[int, ...]) -> None:
    """Enough free space to preallocate every file, per filesystem."""
    need: dict[int, int] = {}
    where: dict[int, str] = {}
    for fd, path in zip(fds, cfg.paths, strict=True):
        parent = os.path.dirname(os.path.abspath(path))
        st = os.fstat(fd)
        dev, have = st.st_dev, st.st_blocks * 512
        need[dev] = need.get(dev, 0) + max(0, cfg.file_bytes - have)
        where[dev] = parent
    for dev, nbytes in need.items():
        st = os.statvfs(where[dev])
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise SsdError(
                f"ssd cache: not enough space in {where[dev]}: the cache files need "
                f"{nbytes / GiB:.2f} GiB more, {free / GiB:.2f} GiB are free; lower "
                "--ssd-cache-capacity or free space"
            )


def _create(fd: int, path: str, sb: Superblock) -> None:
    # The superblock goes last: a crash while preallocating leaves a file
    # that the next start initialises again (INIT_MAGIC says it is ours).
    os.pwrite(fd, INIT_MAGIC.ljust(SUPERBLOCK_BYTES, b"\0"), 0)
    if os.fstat(fd).st_size > sb.file_bytes:
        os.ftruncate(fd, sb.file_bytes)
    try:
        os.posix_fallocate(fd, 0, sb.file_bytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise SsdError(f"ssd cache {path}: preallocating failed: {exc}") from exc
        logger.warning(
            "ssd cache %s: the filesystem cannot preallocate; the file is sparse "
            "and a full disk shows up as write errors",
            path,
        )
        os.ftruncate(fd, sb.file_bytes)
    os.fsync(fd)
    os.pwrite(fd, sb.pack().ljust(SUPERBLOCK_BYTES, b"\0"), 0)
    os.fsync(fd)
    logger.info("ssd cache %s: initialised, %.2f GiB", path, sb.file_bytes / GiB)
