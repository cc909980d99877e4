"""Which filesystem a file or a mapping lies on, from the kernel's mount
tables (/proc/<pid>/mountinfo: the given process's own mount namespace),
by device number. Used where the answer decides something: whether a host
engine's memory is memory (pegaflow.copiers.vm.file_backed), and what a pool
file that CUDA cannot pin lies on (pegaflow.cache.pool)."""

from __future__ import annotations

import functools
import os

# Filesystems whose pages are memory: a copy from them never waits on I/O.
# Mappings of files elsewhere (FUSE above all, whose daemon may be the engine
# itself, or NFS) can hold a copy, and the loop or copy thread doing it,
# for as long as that filesystem likes.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "hugetlbfs", "ramfs", "devtmpfs"})


def device_name(st_dev: int) -> str:
    """ "major:minor" (decimal), as mountinfo writes a device."""
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"


def mount_table(pid: int | str = "self") -> dict[str, tuple[str, str]] | None:
    """Device -> (filesystem type, mount point) as the process's mount
    namespace sees them (the first mount of a device bound twice); None if
    that is unreadable."""
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out: dict[str, tuple[str, str]] = {}
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if sep and len(fields) > 4 and tail:
            out.setdefault(fields[2], (tail.split()[0], fields[4]))
    return out


def filesystem_of(path: str) -> str:
    """'type (mount point)' of the filesystem holding path, for messages."""
    try:
        dev = device_name(os.stat(path).st_dev)
    except OSError:
        return "an unknown filesystem"
    got = (mount_table() or {}).get(dev)
    return "an unknown filesystem" if got is None else f"{got[0]} ({got[1]})"


@functools.cache
def kernel_memory_devices() -> frozenset[str]:
    """Devices of the kernel's internal shmem and hugetlbfs mounts (memfd,
    SysV shm, shared anonymous memory), which no mount table lists: those of
    memfds made here."""
    devices = set()
    hugetlb = getattr(os, "MFD_HUGETLB", 0)
    for flags in (0, hugetlb, hugetlb | getattr(os, "MFD_HUGE_1GB", 0)):
        try:
            fd = os.memfd_create("pegaflow-probe", flags)
        except (OSError, AttributeError):  # no hugetlbfs of that size here
            continue
        try:
            devices.add(device_name(os.fstat(fd).st_dev))
        finally:
            os.close(fd)
    return frozenset(devices)
