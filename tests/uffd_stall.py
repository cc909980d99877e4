"""Make a range of this process's memory stall whoever touches it: its pages
dropped (MADV_DONTNEED) and handed to a userfaultfd that nobody reads, so a
fault there, the server's process_vm_readv included, waits until this process
exits. As docs/security.md says, a privileged engine can do this (root here;
an unprivileged one only with vm.unprivileged_userfaultfd = 1); a FUSE file
mapped over registered memory stalls a copy the same way."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct

PAGE = os.sysconf("SC_PAGE_SIZE")
_NR_USERFAULTFD = 323  # x86_64
_UFFD_API = 0xAA
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_REGISTER_MODE_MISSING = 1
_MADV_DONTNEED = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def stall(address: int, size: int) -> tuple[int, int, int]:
    """The whole pages inside [address, address + size) stall from now on;
    returns (the userfaultfd, first page, bytes). Keep the fd open."""
    lo = -(-address // PAGE) * PAGE
    hi = (address + size) // PAGE * PAGE
    if hi <= lo:
        raise ValueError(f"no whole page in [{address:#x}, {address + size:#x})")
    if platform.machine() != "x86_64":  # the syscall's number is x86_64's
        raise OSError(errno.ENOSYS, f"userfaultfd: not wired for {platform.machine()}")
    fd = _libc.syscall(_NR_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "userfaultfd")
    try:
        fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, 0, 0)))
        if _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED):
            raise OSError(ctypes.get_errno(), "madvise")
        reg = struct.pack("QQQQ", lo, hi - lo, _UFFDIO_REGISTER_MODE_MISSING, 0)
        fcntl.ioctl(fd, _UFFDIO_REGISTER, bytearray(reg))
    except BaseException:
        os.close(fd)
        raise
    return fd, lo, hi - lo
