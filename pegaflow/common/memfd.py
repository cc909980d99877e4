"""What every side's memfd handling shares: the seals and the libc mmap calls.

A host engine backs its KV memory with a sealed memfd and maps it over that
memory (pegaflow.client.host_share); the server checks it and maps it too
(pegaflow.copiers.shared_kv); the pool keeper holds the pool's
(pegaflow.cache.pool_keeper). Python's mmap module can neither map at a fixed
address nor hand back a mapping's address, hence libc's own calls.

Standard library only: the pool keeper runs on this and nothing else.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

# Sealed against shrinking and growing, and the seals sealed too: no truncate,
# by the owner or by root, through /proc/PID/fd or otherwise, can take a page
# from under a mapping of the file (its next touch would be a SIGBUS).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def sealed(fd: int) -> bool:
    """A memfd that can never shrink or grow, nor be unsealed."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    except OSError:  # not a memfd (or shmem) at all
        return False


def map_shared(fd: int, size: int, offset: int = 0, at: int | None = None) -> int:
    """`size` bytes of the file from `offset`, mapped shared and read-write at
    `at` (MAP_FIXED: it replaces what was mapped there) or where the kernel
    chooses; its address. Populated now, once: a copy through it, or the
    engine's forward over it, never faults on each 4 KiB page's first touch."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_SHARED | _MAP_POPULATE | (0 if at is None else _MAP_FIXED)
    got = _mmap(at, size, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED or (at is not None and got != at):
        err = ctypes.get_errno()
        where = "" if at is None else f" over {at:#x}"
        raise OSError(err, f"mmap of {size} B{where}: {os.strerror(err)}")
    return got


def unmap(address: int, size: int) -> None:
    """Undo map_shared; the file lives on while other mappings or fds hold it."""
    _munmap(address, size)
