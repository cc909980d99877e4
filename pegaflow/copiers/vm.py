"""process_vm_readv / process_vm_writev, bound once with ctypes (which drops
the GIL around the call), and the numpy helpers that turn descriptor tables
into iovec arrays and check them against a process's mappings. Used by the host
copy engine and by the per-layer load signals; nothing else moves bytes this way.

Both calls need ptrace access to the engine: same user, and under Yama
ptrace_scope 1 the engine must allow the server with prctl(PR_SET_PTRACER).
A call for a registered engine runs with the engine's own ids
(pegaflow.common.thread_creds), so the kernel's check, made in the call under
the lock an exec takes, refuses a program the engine exec'd with more rights.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from typing import Literal

import numpy as np

from pegaflow.common import deadlines, mounts
from pegaflow.common.errors import CopyFailed, InvalidRequest, PegaflowError
from pegaflow.common.pidfds import NOWHERE, ProcessChanged
from pegaflow.common.thread_creds import AsEngine, EngineIds, mode

IOV_MAX = 1024  # the kernel's UIO_MAXIOV; more iovecs on one side is EINVAL
# Below this many bytes in one batch, a second thread costs more than it saves.
Direction = Literal["gather", "scatter"]

PTRACE_HINT = (
    "the server needs ptrace permission on the engine: same user, and with Yama "
    "ptrace_scope=1 the engine must call prctl(PR_SET_PTRACER, <server pid>), "
    "or the server needs CAP_SYS_PTRACE"
)


def bind(name: str) -> Callable[..., int]:
    # __getitem__ gives a private function object, so these argtypes are ours.
    fn = ctypes.CDLL(None, use_errno=True)[name]
    fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong)
    fn.argtypes += (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
    fn.restype = ctypes.c_ssize_t
    return fn


READV = bind("process_vm_readv")
WRITEV = bind("process_vm_writev")


def merge_spans(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of [start, end) ranges as sorted spans; touching ranges join."""
    if not starts.size:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, reach = starts[order], np.maximum.accumulate(ends[order])
    first = np.flatnonzero(np.concatenate(([True], s[1:] > reach[:-1])))
    last = np.append(first[1:], len(s)) - 1
    return s[first], reach[last]


def first_outside(
    starts: np.ndarray, ends: np.ndarray, addr: np.ndarray, nbytes: np.ndarray
) -> int:
    """Index of the first [addr, addr + nbytes) not inside one span, else -1."""
    if not starts.size:
        return 0 if addr.size else -1
    end = addr + nbytes  # wraps past 2**64 for a bogus range: caught by end >= addr
    i = np.searchsorted(starts, addr, side="right") - 1
    ok = (i >= 0) & (end >= addr) & (end <= ends[np.maximum(i, 0)])
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else -1


def iovecs(addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """(n, 2) uint64 rows, laid out as C `struct iovec {base, len}`."""
    out = np.empty((len(addr), 2), np.uint64)
    out[:, 0] = addr
    out[:, 1] = nbytes
    return out


def advance(
    liov: np.ndarray, riov: np.ndarray, done: int
) -> tuple[np.ndarray, np.ndarray]:
    """The iovecs left after the first `done` bytes (< total) were copied."""
    ends = np.cumsum(liov[:, 1])
    i = int(np.searchsorted(ends, done, side="right"))
    # Bytes of iovec i already copied: the kernel may stop inside an iovec.
    cut = np.uint64(done - int(ends[i] - liov[i, 1]))
    liov, riov = liov[i:].copy(), riov[i:].copy()
    for iov in (liov, riov):
        iov[0, 0] += cut
        iov[0, 1] -= cut
    return liov, riov


def failure(
    op: Direction,
    pid: int,
    err: int,
    liov: np.ndarray,
    riov: np.ndarray,
    ids: EngineIds | None = None,
) -> PegaflowError:
    """The error for a call that failed (err = 0: made no progress)."""
    name = errno.errorcode.get(err, f"errno {err}") if err else "no progress"
    where = f"engine 0x{int(riov[0, 0]):x}, local 0x{int(liov[0, 0]):x}"
    if err == errno.EPERM and ids is not None and mode(ids) in ("drop", "switch"):
        # The kernel judged the process as it is now, with the rights of the
        # user that registered it: it holds rights that user lacks (or, at
        # registration, refuses that user).
        return ProcessChanged(
            f"{op} with engine process {pid} refused by the kernel (EPERM) with "
            f"the rights of uid {ids.uid} gid {ids.gid}, as which the server "
            "copies for it: the process runs a setuid, setgid or file-capability "
            "program, or is not dumpable, or (Yama ptrace_scope 1) has not "
            "allowed the server with prctl(PR_SET_PTRACER)"
        )
    if err == errno.ESRCH:
        why = f"engine process {pid} is gone"
    elif err == errno.EPERM:
        why = PTRACE_HINT
    elif err in (errno.EFAULT, 0):
        why = f"memory not mapped or not accessible at {where}"
    else:
        why = f"{os.strerror(err)} at {where}"
    return CopyFailed(f"{op} with engine process {pid} failed ({name}): {why}")


def transfer(
    op: Direction,
    pid: int,
    liov: np.ndarray,
    riov: np.ndarray,
    deadline: float | None = None,
    ids: EngineIds | None = None,
) -> None:
    """One call of at most IOV_MAX iovecs, resumed after short transfers. The
    deadline is checked right before every syscall: a server that was stopped
    (SIGSTOP, a long GC) between calls must not write into an engine that has
    given up on this request. ids: the engine's, as it registered; each call
    runs as that user (AsEngine), so that the kernel refuses a program the
    process exec'd since with rights that user lacks (ProcessChanged)."""
    call = READV if op == "gather" else WRITEV
    left = int(liov[:, 1].sum())
    while True:
        deadlines.check(deadline, op)
        n = len(liov)
        with AsEngine(ids):  # the system call only: nothing else as that user
            got = call(pid, liov.ctypes.data, n, riov.ctypes.data, n, 0)
            err = ctypes.get_errno() if got < 0 else 0  # before the way back
        if got <= 0:
            raise failure(op, pid, err, liov, riov, ids)
        left -= got
        if left == 0:
            return
        # A fault or the kernel's ~2 GiB per-call cap stops short: go on from
        # the exact byte, so a real fault shows up as -1 on the next call.
        liov, riov = advance(liov, riov, got)


def check_access(pid: int, ids: EngineIds | None = None) -> None:
    """Whether the kernel lets the server, as the engine's user, read and
    write `pid`'s memory, asked without touching that memory: one byte read
    at NOWHERE fails EFAULT where it may (the kernel checks access first),
    EPERM where it may not, ESRCH for a process that is gone. A read of a
    page the engine maps could wait on the engine for good (a FUSE file or a
    userfaultfd registered there), and registration runs on the event loop.
    Raises as transfer() does."""
    byte = np.zeros(1, np.uint8)
    one = np.ones(1, np.uint64)
    liov = iovecs(np.array([byte.ctypes.data], np.uint64), one)
    riov = iovecs(np.array([NOWHERE], np.uint64), one)
    with AsEngine(ids):  # the system call only
        got = READV(pid, liov.ctypes.data, 1, riov.ctypes.data, 1, 0)
        err = ctypes.get_errno() if got < 0 else 0
    if err != errno.EFAULT:
        raise failure("gather", pid, err, liov, riov, ids)


def read_maps(pid: int, field: str = "pid") -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise InvalidRequest(f"{field}: process {pid} does not exist") from None
    except PermissionError:
        raise InvalidRequest(
            f"{field}: cannot read /proc/{pid}/maps; {PTRACE_HINT}"
        ) from None
    if not lines:  # a zombie: killed but not yet reaped by its parent
        raise InvalidRequest(f"{field}: process {pid} has exited")
    return lines


def rw_spans(pid: int, lines: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read-write mappings of `pid`, merged where adjacent."""
    if lines is None:
        lines = read_maps(pid)
    ranges = [ln.split(maxsplit=2)[:2] for ln in lines]
    rw = [r.split("-") for r, perms in ranges if perms.startswith("rw")]
    starts = np.array([int(s, 16) for s, _ in rw], np.uint64)
    ends = np.array([int(e, 16) for _, e in rw], np.uint64)
    return merge_spans(starts, ends)


def file_backed(
    pid: int, lines: list[str], addr: np.ndarray, size: np.ndarray
) -> tuple[int, str] | None:
    """(i, what) for the first range [addr[i], addr[i] + size[i]) that overlaps
    a mapping of a file that is not memory; None when every page is anonymous
    or memory. Memory: the kernel's own shmem and hugetlbfs (memfd, SysV shm,
    shared anonymous memory), or a filesystem the engine's mount table lists
    as one of mounts.MEMORY_FILESYSTEMS. A device that table does not list
    (a FUSE mount of another namespace, its file passed in) is not memory."""
    files = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) >= 5 and parts[4] != "0":
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            files.append(
                (lo, hi, f"{major}:{minor}", parts[5] if len(parts) > 5 else "")
            )
    if not files:
        return None
    table = mounts.mount_table(pid)
    kernel = mounts.kernel_memory_devices()
    for i, (a, n) in enumerate(zip(addr.tolist(), size.tolist(), strict=True)):
        for lo, hi, dev, path in files:
            if not (lo < a + n and a < hi) or dev in kernel:
                continue
            name = path or "a file"
            if table is None:
                return i, f"{name} (the engine's mount table is unreadable)"
            if dev not in table:
                return i, f"{name} on device {dev}, which the engine's mounts lack"
            fstype = table[dev][0]
            if fstype not in mounts.MEMORY_FILESYSTEMS:
                return i, f"{name} on {fstype}"
    return None
