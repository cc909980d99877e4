"""File I/O of the SSD tier: one small interface, two backends chosen once at start.

A backend moves bytes between a data file and host memory named by raw address
and length (pool slots are raw addresses in the pool's mmap'd region). Offsets,
lengths and addresses are 4 KiB-aligned, so O_DIRECT and GDS both apply: a
write gathers a run of records from header pages in an aligned buffer and
payloads straight from the pool's slots where those are aligned; the store
stages the rest through aligned buffers (`AlignedBuffer`).

- `PosixIO`: os.preadv/os.pwritev on descriptors opened with O_DIRECT where the
  filesystem allows it, buffered otherwise (logged, and reported in `mode`).
- `gds.kvikio_io.KvikioIO`: kvikio's CuFile; GPUDirect Storage where the machine
  has it, kvikio's POSIX compatibility mode elsewhere. Needs libcuda.so.1.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Literal, Protocol

import numpy as np

from pegaflow.common.runs import Part  # (host address, bytes)

from .checked_paths import SsdError, reopen_path, same_file
from .format import ALIGN

logger = logging.getLogger(__name__)

BackendName = Literal["auto", "posix", "kvikio"]
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
DirectIO = Literal["auto", "on", "off"]


class FileIO(Protocol):
    """Byte mover between data files and host memory. Thread-safe: the store calls
    it from several I/O threads at once."""

    mode: str  # what is in use, for the log and /metrics (e.g. "posix-odirect")

    def pread(self, file: int, address: int, nbytes: int, offset: int) -> None: ...
    def pwrite(self, file: int, address: int, nbytes: int, offset: int) -> None: ...
    def pwritev(self, file: int, parts: Sequence[Part], offset: int) -> None:
        """Write the (address, bytes) parts back to back from offset on, all
        or an OSError (one request where the backend can: a gather write)."""
        ...

    def preadv(self, file: int, parts: Sequence[Part], offset: int) -> None:
        """Read into the (address, bytes) parts back to back from offset on, all
        or an OSError (one request where the backend can: a scatter read)."""
        ...

    def sync(self) -> None: ...
    def close(self) -> None: ...


def host_view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview over raw host memory (no copy)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


# host_views slices parts out of one window over the address space: one
# ctypes array type (ctypes caches a type per length, forever), one
# from_address per call, then a memoryview slice per part, rather than a
# ctypes array per part (~0.8 us each, twice per block on a write). Only the
# parts' own bytes are ever touched through the window.
_WINDOW_BYTES = 1 << 41
_Window = ctypes.c_ubyte * _WINDOW_BYTES


def host_views(parts: Sequence[Part]) -> list[memoryview]:
    """host_view of each (address, bytes) part, made cheaply (see _Window);
    parts spread wider than the window (not the pool's) get a view each."""
    if not parts:
        return []
    lo, hi = min(parts)[0], max(parts)[0]  # C-level: tuples order by address
    if hi + max(map(itemgetter(1), parts)) - lo > _WINDOW_BYTES:
        return [host_view(a, n) for a, n in parts]
    window = memoryview(_Window.from_address(lo)).cast("B")
    return [window[a - lo : a - lo + n] for a, n in parts]


def copy_within(dst: np.ndarray, src: np.ndarray, nbytes: int) -> None:
    """Copy nbytes from each src[i] to dst[i] (uint64 addresses of this
    process). All in one compiled call that runs without the GIL, libc's
    memmove apiece: a ctypes memmove per row drops the GIL and takes it back
    for each, a turn per staged block in which a save-path thread can be
    made to wait (benchmarks/RESULTS.md, thirteenth session: the host path's
    write-behind loss 45 -> 41 % on the dev VM). Without numba, or where the
    compiled copy fails its check, a ctypes memmove per row."""
    if dst.shape != src.shape:
        raise ValueError(f"copy_within: {dst.shape} destinations, {src.shape} sources")
    copy = _compiled_copy()
    if copy is None:
        move = ctypes.memmove
        for d, s in zip(dst.tolist(), src.tolist(), strict=True):
            move(d, s, nbytes)
        return
    copy(
        np.ascontiguousarray(dst, np.uint64),
        np.ascontiguousarray(src, np.uint64),
        nbytes,
    )


@functools.cache
def _compiled_copy() -> Callable[[np.ndarray, np.ndarray, int], None] | None:
    """The compiled loop, checked on a few rows; None without numba or when
    it copies otherwise than it should (said in the log)."""
    from pegaflow.common.jit import checked_nogil

    memmove = ctypes.CDLL(None).memmove  # this process's C library
    memmove.restype = ctypes.c_uint64
    memmove.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]

    def copy_rows(dst: np.ndarray, src: np.ndarray, nbytes: int) -> None:
        for i in range(dst.shape[0]):
            memmove(dst[i], src[i], nbytes)

    return checked_nogil(
        copy_rows, _check_copy, "staged copies by ctypes, one call a row", logger
    )


def _check_copy(copy: Callable[[np.ndarray, np.ndarray, int], None]) -> None:
    """Two rows copied crosswise must land crosswise."""
    data = np.random.default_rng(0).integers(0, 256, 2 * 3000, np.uint8)
    out = np.zeros_like(data)
    rows = np.array([3000, 0], np.uint64)
    copy(out.ctypes.data + rows[::-1], data.ctypes.data + rows, 3000)
    if not np.array_equal(out, np.roll(data, 3000)):
        raise ValueError("the compiled copy moved other bytes")


def warm_copies() -> bool:
    """Compile and check the copy loop now, not in a writer's first run:
    whether copy_within uses it."""
    return _compiled_copy() is not None


class AlignedBuffer:
    """Page-aligned anonymous memory that grows on demand (one per I/O thread)."""

    def __init__(self, nbytes: int = 1 << 20) -> None:
        self._map: mmap.mmap | None = None
        self.size = 0
        self.address = 0
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        size = -(-nbytes // ALIGN) * ALIGN
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        old, self._map = self._map, region
        self._array = np.frombuffer(region, np.uint8)
        self.address = int(self._array.ctypes.data)
        self.size = size
        if old is not None:
            old.close()

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        return memoryview(self._array)[start:stop]

    def close(self) -> None:
        if self._map is not None:
            del self._array
            self._map.close()
            self._map = None
            self.size = 0


def _short(op: str, done: int, want: int, file: int, offset: int) -> OSError:
    return OSError(errno.EIO, f"short {op} on file {file} at {offset}: {done}/{want}")


class PosixIO:
    """preadv/pwritev from the caller's threads; the GIL is dropped for each
    syscall, so several threads keep several requests in flight."""

    def __init__(
        self,
        paths: Sequence[str],
        direct: DirectIO,
        checked: Sequence[int] | None = None,
    ) -> None:
        """checked: files.py's descriptors of the paths (reopen_path)."""
        self.fds: list[int] = []
        self.direct = False
        try:
            for i, path in enumerate(paths):
                was = None if checked is None else checked[i]
                fd = self._open(reopen_path(was, path), direct, path)
                self.fds.append(fd)
                same_file(was, fd, path)
        except BaseException:
            self.close()
            raise
        self.mode = "posix-odirect" if self.direct else "posix-buffered"
        logger.info("ssd backend: %s", self.mode)

    def _open(self, path: str, direct: DirectIO, name: str) -> int:
        """path: where to open it (reopen_path); name: the file as the
        messages call it."""
        flags = os.O_RDWR | os.O_CLOEXEC  # files.py checked it
        if not path.startswith("/proc/self/fd/"):  # that one is a link by design
            flags |= os.O_NOFOLLOW
        fell_back = bool(self.fds) and not self.direct
        if direct == "off" or fell_back:
            return os.open(path, flags)
        fd = -1
        try:
            fd = os.open(path, flags | os.O_DIRECT)
            _probe_direct(fd)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            if direct == "on" or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise SsdError(
                    f"ssd cache {name}: O_DIRECT not usable here ({exc}); "
                    "use --ssd-direct-io auto (falls back) or off"
                ) from exc
            if self.fds:  # the files before this one took O_DIRECT
                raise SsdError(
                    f"ssd cache {name}: O_DIRECT works for the other cache files "
                    "but not this one; put them on alike filesystems"
                ) from exc
            logger.warning(
                "ssd cache %s: the filesystem refuses O_DIRECT (%s); using "
                "buffered I/O, through the page cache",
                name,
                exc.strerror,
            )
            return os.open(path, flags)
        self.direct = True
        return fd

    def pread(self, file: int, address: int, nbytes: int, offset: int) -> None:
        self.preadv(file, [(address, nbytes)], offset)

    def preadv(self, file: int, parts: Sequence[Part], offset: int) -> None:
        self._vector(os.preadv, "read", file, parts, offset)

    def pwrite(self, file: int, address: int, nbytes: int, offset: int) -> None:
        self.pwritev(file, [(address, nbytes)], offset)

    def pwritev(self, file: int, parts: Sequence[Part], offset: int) -> None:
        self._vector(os.pwritev, "write", file, parts, offset)

    def _vector(
        self,
        call: Callable[[int, list[memoryview], int], int],
        op: str,
        file: int,
        parts: Sequence[Part],
        offset: int,
    ) -> None:
        """preadv / pwritev of all the parts: IOV_MAX parts a call, and a call
        that comes short (a long request, a signal) resumed where it stopped; a
        read that hits the end of the file (0) is an error."""
        if not all(map(itemgetter(1), parts)):
            parts = [p for p in parts if p[1]]
        views = host_views(parts)
        want = sum(map(itemgetter(1), parts))
        done = i = 0
        while i < len(views):
            batch = views[i : i + IOV_MAX]
            n = call(self.fds[file], batch, offset + done)
            if n <= 0:
                raise _short(op, done, want, file, offset)
            done += n
            if n == sum(map(len, batch)):  # the usual whole call: no walk per part
                i += len(batch)
                continue
            while n:
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i], n = views[i][n:], 0

    def sync(self) -> None:
        for fd in self.fds:
            os.fdatasync(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _probe_direct(fd: int) -> None:
    """Some filesystems accept O_DIRECT at open and fail the first I/O: read the
    superblock page through it once."""
    buf = AlignedBuffer(ALIGN)
    try:
        os.preadv(fd, [buf.view(0, ALIGN)], 0)
    finally:
        buf.close()


def open_backend(
    name: BackendName,
    paths: Sequence[str],
    direct: DirectIO,
    threads: int = 8,
    checked: Sequence[int] | None = None,
) -> FileIO:
    """The backend, chosen once: 'auto' takes kvikio where it and a CUDA driver
    are present, POSIX elsewhere. `threads`: I/O requests the tier keeps in
    flight (kvikio sizes its own pool to it). `checked`: files.py's
    descriptors of the paths, the files the backend opens (reopen_path)."""
    if name in ("auto", "kvikio"):
        from . import kvikio_io

        why = kvikio_io.unavailable()
        if why is None:
            return kvikio_io.KvikioIO(paths, threads, checked)
        if name == "kvikio":
            raise SsdError(f"--ssd-backend kvikio: {why}")
        logger.info("ssd backend: kvikio not usable (%s)", why)
    return PosixIO(paths, direct, checked)
