"""kvikio backend of the SSD tier: CuFile reads and writes of host buffers.

GPUDirect Storage where the machine has it (nvidia-fs and a supported
filesystem), kvikio's POSIX compatibility mode elsewhere; which one is in use is
logged and reported in `mode`. kvikio opens no file without a CUDA driver, so it is
only chosen where libcuda.so.1 loads. Imported lazily: the server runs without it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def unavailable() -> str | None:
    """Why kvikio cannot be used here, or None when it can."""
    try:
        import kvikio  # noqa: F401
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


def _compat(handle: Any, kvikio: Any) -> bool:
    """Whether kvikio will do POSIX I/O for this file (APIs moved across
    releases: ask the file first, then the global default)."""
    ask = getattr(handle, "is_compat_mode_preferred", None)
    if callable(ask):
        return bool(ask())
    defaults = kvikio.defaults
    if hasattr(defaults, "get"):
        mode = defaults.get("compat_mode")
    else:
        mode = defaults.compat_mode()
    return str(getattr(mode, "name", mode)).upper() in ("ON", "TRUE", "1")


class KvikioIO:
    def __init__(self, paths: Sequence[str]) -> None:
        import kvikio

        self.paths = list(paths)
        self.files: list[Any] = []
        try:
            for path in paths:
                self.files.append(kvikio.CuFile(path, "r+"))
        except BaseException:
            self.close()
            raise
        compat = _compat(self.files[0], kvikio)
        self.mode = "kvikio-compat" if compat else "kvikio-gds"
        logger.info(
            "ssd backend: kvikio %s (%s)",
            getattr(kvikio, "__version__", "?"),
            "POSIX compatibility mode: no GPUDirect Storage here"
            if compat
            else "GPUDirect Storage",
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

    def sync(self) -> None:
        # CuFile exposes no fsync; a descriptor of our own flushes the same inode.
        for path in self.paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []
