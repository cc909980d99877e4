"""Test access to a kept pool (pegaflow.cache.pool_keeper): its keeper's pid,
its memfd through /proc (as its owner or root could reach it), an old-style
regular pool file made of it, and a keeper stopped the way an operator frees
the pool (`rm PATH`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from pegaflow.cache.pool_keeper import peer


def keeper_pid(path: Path) -> int:
    """The pid of the process listening at PATH (SO_PEERCRED). Connecting
    claims the pool for an instant if no server holds it; closing gives it
    back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(30)
        s.connect(str(path))
        return peer(s)[0]


def memfd_path(pid: int) -> str:
    """/proc/PID/fd/N of the pool's memfd in that process."""
    for name in os.listdir(f"/proc/{pid}/fd"):
        link = f"/proc/{pid}/fd/{name}"
        with contextlib.suppress(OSError):
            if os.readlink(link).startswith("/memfd:pegaflow-pool"):
                return link
    raise AssertionError(f"pid {pid} holds no pool memfd")


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    """The kept pool's bytes, mapped shared (writable), through its keeper's
    descriptor: the test reads and damages them as the pool's owner could."""
    fd = os.open(memfd_path(keeper_pid(path)), os.O_RDWR)
    try:
        m = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    try:
        yield m
    finally:
        m.close()


def gone(pid: int) -> bool:
    """Exited (or a zombie its new parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while not gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} still there"
        time.sleep(0.05)


def free(path: Path) -> None:
    """`rm PATH`, then wait for its keeper to exit (within 1 s, loaded: 30)."""
    if not stat.S_ISSOCK(path.lstat().st_mode):  # a symlink to one too
        return
    try:
        pid = keeper_pid(path)
    except OSError:  # a dead keeper's socket
        path.unlink()
        return
    path.unlink()
    wait_gone(pid)


def to_old_file(path: Path) -> None:
    """Turn a kept pool into the regular pool file a server before 2026-12-05
    kept at PATH (same bytes, mode 0600), its keeper stopped."""
    with mapped(path) as m:
        raw = bytes(m)
    free(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
