"""kvikio backend of the SSD tier: CuFile reads and writes of host buffers.

GPUDirect Storage where the machine has it (nvidia-fs and a supported
filesystem), kvikio's POSIX compatibility mode elsewhere; which one is in use is
logged and reported in `mode`. kvikio opens no file without a CUDA driver, so it is
only chosen where libcuda.so.1 loads. Imported lazily: the server runs without it.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checked_paths import reopen_path, same_file

logger = logging.getLogger(__name__)


def load_kvikio() -> tuple[Any, Any, Any]:
    """(kvikio, kvikio.defaults, CuFile), each imported by name: kvikio 26.x no
    longer imports `kvikio.defaults` from its package __init__, so reading it as
    an attribute of the package fails. Nothing here reaches a submodule through
    the package's attributes. CuFile comes from `kvikio.cufile` where the
    package does not re-export it."""
    kvikio = importlib.import_module("kvikio")
    defaults = importlib.import_module("kvikio.defaults")
    cufile = getattr(kvikio, "CuFile", None)
    if cufile is None:
        cufile = importlib.import_module("kvikio.cufile").CuFile
    return kvikio, defaults, cufile


def unavailable() -> str | None:
    """Why kvikio cannot be used here, or None when it can."""
    try:
        load_kvikio()
    except ImportError as exc:
        return f"kvikio is not installed ({exc}); pip install 'pegaflow-py[gds]'"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1 does not load)"
    return None


def check(done: int, want: int, op: str, offset: int) -> None:
    """The one status check of every kvikio call."""
    if done != want:
        raise OSError(errno.EIO, f"kvikio short {op} at {offset}: {done}/{want}")


def compat_mode(defaults: Any) -> bool:
    """Whether kvikio will do POSIX I/O instead of cuFile (GDS). kvikio's
    default mode is AUTO, resolved at run time (no libcufile, no /run/udev, WSL:
    compat); ask kvikio for the resolved answer where it can give it."""
    resolved = getattr(defaults, "is_compat_mode_preferred", None)
    if callable(resolved):
        return bool(resolved())
    mode = defaults.get("compat_mode") if hasattr(defaults, "get") else None
    return str(getattr(mode, "name", mode)).upper() in ("ON", "TRUE", "1")


def configure(defaults: Any, threads: int) -> dict[str, object]:
    """O_DIRECT for kvikio's POSIX path (host buffers always take it, GDS or
    not) and a thread pool as deep as the tier's I/O threads: kvikio's default
    of one thread would serialise every request the tier has in flight.
    Environment variables (KVIKIO_NTHREADS, KVIKIO_AUTO_DIRECT_IO_*) win."""
    want: dict[str, object] = {}
    if "KVIKIO_NTHREADS" not in os.environ:
        want["num_threads"] = threads
    for op in ("read", "write"):
        if f"KVIKIO_AUTO_DIRECT_IO_{op.upper()}" not in os.environ:
            want[f"auto_direct_io_{op}"] = True
    for name, value in want.items():
        try:
            defaults.set(name, value)
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            logger.warning("kvikio: cannot set %s=%s (%s)", name, value, exc)
    got: dict[str, object] = {}
    for name in ("num_threads", "auto_direct_io_read", "auto_direct_io_write"):
        try:
            got[name] = defaults.get(name)
        except (ValueError, KeyError, AttributeError, TypeError):
            got[name] = "?"
    return got


def open_checked(
    cufile: Any, paths: Sequence[str], flags: str, checked: Sequence[int] | None
) -> list[Any]:
    """CuFiles of the data files files.py checked at descriptors `checked`:
    kvikio opens by name, so each is opened through /proc/self/fd/<checked>
    (checked_paths.reopen_path), never by a path that may name another file by now;
    and where kvikio tells its descriptor, that is checked to be the same
    file. All closed again on an error."""
    files: list[Any] = []
    try:
        for i, path in enumerate(paths):
            was = None if checked is None else checked[i]
            f = cufile(reopen_path(was, path), flags)
            files.append(f)
            fileno = getattr(f, "fileno", None)
            if was is not None and callable(fileno):
                same_file(was, fileno(), path)
    except BaseException:
        for f in files:
            f.close()
        raise
    return files


class KvikioIO:
    def __init__(
        self,
        paths: Sequence[str],
        threads: int = 8,
        checked: Sequence[int] | None = None,
    ) -> None:
        """checked: files.py's descriptors of the paths (open_checked); also
        what sync() flushes."""
        kvikio, defaults, cufile = load_kvikio()
        settings = configure(defaults, threads)
        self.paths = list(paths)
        self._checked = None if checked is None else list(checked)
        self.files: list[Any] = open_checked(cufile, paths, "r+", checked)
        compat = compat_mode(defaults)
        self.mode = "kvikio-compat" if compat else "kvikio-gds"
        direct = getattr(self.files[0], "is_direct_io_supported", lambda: "?")()
        logger.info(
            "ssd backend: kvikio %s (%s; O_DIRECT %s; %s)",
            getattr(kvikio, "__version__", "?"),
            "POSIX compatibility mode: no GPUDirect Storage here"
            if compat
            else "GPUDirect Storage",
            direct,
            ", ".join(f"{k}={v}" for k, v in settings.items()),
        )

    @staticmethod
    def _host(address: int, nbytes: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))

    def pread(self, file: int, address: int, nbytes: int, offset: int) -> None:
        fut = self.files[file].pread(self._host(address, nbytes), nbytes, offset)
        check(fut.get(), nbytes, "read", offset)

    def pwrite(self, file: int, address: int, nbytes: int, offset: int) -> None:
        fut = self.files[file].pwrite(self._host(address, nbytes), nbytes, offset)
        check(fut.get(), nbytes, "write", offset)

    def pwritev(self, file: int, parts: Sequence[tuple[int, int]], offset: int) -> None:
        """One kvikio write per part, all in flight at once; every one is waited
        for before this returns or raises (the caller reuses the memory)."""
        self._vector("pwrite", "write", file, parts, offset)

    def preadv(self, file: int, parts: Sequence[tuple[int, int]], offset: int) -> None:
        """One kvikio read per part, all in flight at once; every one is waited
        for before this returns or raises (the caller verifies or frees the
        memory then)."""
        self._vector("pread", "read", file, parts, offset)

    def _vector(
        self,
        method: str,
        op: str,
        file: int,
        parts: Sequence[tuple[int, int]],
        offset: int,
    ) -> None:
        call = getattr(self.files[file], method)
        futures = []
        at = offset
        failed: BaseException | None = None
        for address, nbytes in parts:
            if nbytes:
                try:
                    fut = call(self._host(address, nbytes), nbytes, at)
                except BaseException as exc:  # still wait for those in flight
                    failed = exc
                    break
                futures.append((fut, nbytes, at))
            at += nbytes
        for fut, nbytes, at in futures:
            try:
                check(fut.get(), nbytes, op, at)
            except BaseException as exc:  # wait for the rest all the same
                failed = failed or exc
        if failed is not None:
            raise failed

    def sync(self) -> None:
        # CuFile exposes no fsync; a descriptor of our own flushes the same
        # inode: files.py's, else one opened by name (never through a link).
        if self._checked is not None:
            for fd in self._checked:
                os.fdatasync(fd)
            return
        for path in self.paths:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []
