"""Host copy engine: moves KV bytes between engines' CPU memory and the pool.

An engine whose KV cache lives in host memory registers (pid, address, size)
regions. The server then copies with process_vm_readv / process_vm_writev, which
take a whole scatter list per syscall: descriptor tables are bounds-checked,
coalesced and turned into iovec arrays with numpy, never a Python loop per block.
Calls are spread over a few threads because one syscall copies on one core (and
ctypes releases the GIL around it).

Both calls need ptrace access to the engine: same user, and under Yama
ptrace_scope 1 the engine must allow the server with prctl(PR_SET_PTRACER).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import numpy as np

from pegaflow import deadlines
from pegaflow.errors import CopyFailed, InternalError, InvalidRequest
from pegaflow.layout import Transfers
from pegaflow.runs import merge_adjacent

logger = logging.getLogger(__name__)

IOV_MAX = 1024  # the kernel's UIO_MAXIOV; more iovecs on one side is EINVAL
# Below this many bytes in one batch, a second thread costs more than it saves.
PARALLEL_MIN_BYTES = 4 << 20

Direction = Literal["gather", "scatter"]

_PTRACE_HINT = (
    "the server needs ptrace permission on the engine: same user, and with Yama "
    "ptrace_scope=1 the engine must call prctl(PR_SET_PTRACER, <server pid>), "
    "or the server needs CAP_SYS_PTRACE"
)


def _bind(name: str) -> Callable[..., int]:
    # __getitem__ gives a private function object, so these argtypes are ours.
    fn = ctypes.CDLL(None, use_errno=True)[name]
    fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong)
    fn.argtypes += (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _bind("process_vm_readv")
_writev = _bind("process_vm_writev")


@dataclass(frozen=True, slots=True)
class HostRegions:
    """Memory of one engine process that the server may copy to and from."""

    pid: int
    bases: tuple[int, ...]
    sizes: tuple[int, ...]
    # A pidfd names the process itself, not its number: once it exits, a new
    # process that reuses the pid can never receive this engine's copies.
    pidfd: int = -1


def _merge_spans(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of [start, end) ranges as sorted spans; touching ranges join."""
    if not starts.size:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, reach = starts[order], np.maximum.accumulate(ends[order])
    first = np.flatnonzero(np.concatenate(([True], s[1:] > reach[:-1])))
    last = np.append(first[1:], len(s)) - 1
    return s[first], reach[last]


def _first_outside(
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


def _coalesce(
    local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs where both sides continue exactly where the previous ended."""
    (local, remote), nbytes = merge_adjacent([local, remote], nbytes)
    return local, remote, nbytes


def _iovecs(addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """(n, 2) uint64 rows, laid out as C `struct iovec {base, len}`."""
    return np.ascontiguousarray(np.stack((addr, nbytes), axis=1), np.uint64)


def _advance(
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


def _failure(
    op: Direction, pid: int, err: int, liov: np.ndarray, riov: np.ndarray
) -> CopyFailed:
    """The CopyFailed for a call that failed (err = 0: made no progress)."""
    name = errno.errorcode.get(err, f"errno {err}") if err else "no progress"
    where = f"engine 0x{int(riov[0, 0]):x}, local 0x{int(liov[0, 0]):x}"
    if err == errno.ESRCH:
        why = f"engine process {pid} is gone"
    elif err == errno.EPERM:
        why = _PTRACE_HINT
    elif err in (errno.EFAULT, 0):
        why = f"memory not mapped or not accessible at {where}"
    else:
        why = f"{os.strerror(err)} at {where}"
    return CopyFailed(f"{op} with engine process {pid} failed ({name}): {why}")


def _transfer(
    op: Direction,
    pid: int,
    liov: np.ndarray,
    riov: np.ndarray,
    deadline: float | None = None,
) -> None:
    """One call of at most IOV_MAX iovecs, resumed after short transfers. The
    deadline is checked right before every syscall: a server that was stopped
    (SIGSTOP, a long GC) between calls must not write into an engine that has
    given up on this request."""
    call = _readv if op == "gather" else _writev
    left = int(liov[:, 1].sum())
    while True:
        deadlines.check(deadline, op)
        n = len(liov)
        got = call(pid, liov.ctypes.data, n, riov.ctypes.data, n, 0)
        if got <= 0:
            raise _failure(op, pid, ctypes.get_errno() if got < 0 else 0, liov, riov)
        left -= got
        if left == 0:
            return
        # A fault or the kernel's ~2 GiB per-call cap stops short: go on from
        # the exact byte, so a real fault shows up as -1 on the next call.
        liov, riov = _advance(liov, riov, got)


def _rw_spans(pid: int) -> tuple[np.ndarray, np.ndarray]:
    """Read-write mappings of `pid`, merged where adjacent."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise InvalidRequest(f"pid: process {pid} does not exist") from None
    except PermissionError:
        raise InvalidRequest(
            f"pid: cannot read /proc/{pid}/maps; {_PTRACE_HINT}"
        ) from None
    if not lines:  # a zombie: killed but not yet reaped by its parent
        raise InvalidRequest(f"pid: process {pid} has exited")
    ranges = [ln.split(maxsplit=2)[:2] for ln in lines]
    rw = [r.split("-") for r, perms in ranges if perms.startswith("rw")]
    starts = np.array([int(s, 16) for s, _ in rw], np.uint64)
    ends = np.array([int(e, 16) for _, e in rw], np.uint64)
    return _merge_spans(starts, ends)


def _pidfd_open(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # kernel < 5.3: fall back to the bare pid
        return -1


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    if pidfd < 0:
        return False
    return bool(select.select([pidfd], [], [], 0)[0])


def _split(count: int, total_bytes: int, threads: int) -> list[slice]:
    """Even slices of at most IOV_MAX iovecs; at least `threads` if large."""
    parts = -(-count // IOV_MAX)
    if total_bytes >= PARALLEL_MIN_BYTES:
        parts = max(parts, min(threads, count))
    edges = (np.arange(parts + 1) * count) // parts
    return [slice(a, b) for a, b in pairwise(edges.tolist())]


class HostCopyEngine:
    """Batched copies between registered engine memory and local memory."""

    def __init__(self, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"threads: need at least 1, got {threads}")
        self._threads = threads
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="hostcopy")
            if threads > 1
            else None
        )

    def open(
        self, pid: int, regions: list[tuple[int, int]], cuda: object = None
    ) -> HostRegions:
        """Check that `pid` lives and maps every (address, size) read-write.

        `cuda` is the CopyEngine seam's GPU export; host workers have none.
        """
        if cuda is not None:
            raise InvalidRequest("regions: host regions carry no CUDA handles")
        if pid <= 0:
            raise InvalidRequest(f"pid: {pid} is not a process id")
        if pid == os.getpid():
            # Loads would write into the server's own memory, pool slots included.
            raise InvalidRequest(f"pid: {pid} is the server itself, not an engine")
        if not regions:
            raise InvalidRequest("regions: at least one (address, size) is required")
        for i, (addr, size) in enumerate(regions):  # a handful, once per engine
            if addr < 0 or size <= 0 or addr + size > 1 << 64:
                raise InvalidRequest(
                    f"regions[{i}]: address {addr:#x} size {size} is not a range"
                )
        addr = np.array([a for a, _ in regions], np.uint64)
        size = np.array([s for _, s in regions], np.uint64)
        bad = _first_outside(*_rw_spans(pid), addr, size)
        if bad >= 0:
            a, s = regions[bad]
            raise InvalidRequest(
                f"regions[{bad}]: [{a:#x}, {a + s:#x}) is not mapped read-write "
                f"in process {pid}"
            )
        # Registration is the place to learn about ptrace permission, not the
        # first save: read one byte.
        probe = np.zeros(1, np.uint8)
        one = np.ones(1, np.uint64)
        local = _iovecs(np.array([probe.ctypes.data], np.uint64), one)
        try:
            _transfer("gather", pid, local, _iovecs(addr[:1], one))
        except CopyFailed as e:
            raise InvalidRequest(f"pid: {e}") from None
        logger.debug(
            "open pid=%d: %d region(s), %d bytes", pid, len(regions), size.sum()
        )
        return HostRegions(
            pid,
            tuple(a for a, _ in regions),
            tuple(s for _, s in regions),
            _pidfd_open(pid),
        )

    def gather(
        self,
        regions: HostRegions,
        t: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Engine -> local: t.src lies in the engine process, t.dst is ours.

        A host engine's save is ordered by the RPC itself: it has no events.
        """
        if wait_event:
            raise InvalidRequest("wait_event: host engines have no CUDA events")
        self._copy("gather", regions, t.dst, t.src, t.nbytes, deadline)

    def scatter(
        self, regions: HostRegions, t: Transfers, deadline: float | None = None
    ) -> None:
        """Local -> engine: t.src is ours, t.dst lies in the engine process."""
        self._copy("scatter", regions, t.src, t.dst, t.nbytes, deadline)

    def close(self, regions: HostRegions) -> None:
        """Host memory needs no unmapping; only the pidfd is released."""
        if regions.pidfd >= 0:
            os.close(regions.pidfd)
        logger.debug("close pid=%d", regions.pid)

    def shutdown(self) -> None:
        """Wait for running copies and stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _copy(
        self,
        op: Direction,
        regions: HostRegions,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        deadline: float | None,
    ) -> None:
        if not len(local) == len(remote) == len(nbytes):
            raise InternalError(
                f"transfers: src, dst, nbytes lengths differ "
                f"({len(local)}, {len(remote)}, {len(nbytes)})"
            )
        local, remote, n = (np.asarray(a, np.uint64) for a in (local, remote, nbytes))
        self._check_bounds(op, regions, remote, n)
        keep = n > 0  # empty iovecs would only complicate resuming
        local, remote, n = local[keep], remote[keep], n[keep]
        if not n.size:
            return
        if _exited(regions.pidfd):
            raise CopyFailed(f"{op}: engine process {regions.pid} is gone")
        local, remote, n = _coalesce(local, remote, n)
        liov, riov = _iovecs(local, n), _iovecs(remote, n)
        total = int(n.sum())
        parts = _split(len(n), total, self._threads)
        msg = "%s pid=%d: %d descriptors -> %d iovecs, %d call(s), %d bytes"
        logger.debug(msg, op, regions.pid, len(keep), len(n), len(parts), total)
        if self._pool is None or len(parts) == 1:
            for part in parts:
                _transfer(op, regions.pid, liov[part], riov[part], deadline)
            return
        futures = [
            self._pool.submit(_transfer, op, regions.pid, liov[p], riov[p], deadline)
            for p in parts
        ]
        wait(futures)  # never return while a chunk still writes
        for f in futures:
            f.result()

    @staticmethod
    def _check_bounds(
        op: Direction, regions: HostRegions, remote: np.ndarray, n: np.ndarray
    ) -> None:
        bases = np.array(regions.bases, np.uint64)
        starts, ends = _merge_spans(bases, bases + np.array(regions.sizes, np.uint64))
        bad = _first_outside(starts, ends, remote, n)
        if bad >= 0:
            field = "src" if op == "gather" else "dst"
            a, s = int(remote[bad]), int(n[bad])
            raise InternalError(
                f"transfers.{field}[{bad}]: [{a:#x}, {a + s:#x}) is outside the "
                f"regions registered for process {regions.pid}"
            )


class LayerSignals:
    """Per-layer load progress words in an engine process's host memory.

    The engine polls word l before running layer l; the server writes a load's
    sequence number there once that layer's bytes have landed. One 8-byte
    process_vm_writev per layer, after the layer's copy returned, so on x86's
    store order the engine never sees the word before the bytes.
    """

    def __init__(self, pid: int, address: int, num_layers: int) -> None:
        if pid <= 0 or pid == os.getpid():
            raise InvalidRequest(f"layer_signals.pid: {pid} is not an engine process")
        if address <= 0 or address % 8:
            raise InvalidRequest(
                f"layer_signals.address: {address:#x} is not an 8-byte aligned address"
            )
        size = 8 * num_layers
        bad = _first_outside(
            *_rw_spans(pid),
            np.array([address], np.uint64),
            np.array([size], np.uint64),
        )
        if bad >= 0:
            raise InvalidRequest(
                f"layer_signals.address: [{address:#x}, {address + size:#x}) is not "
                f"mapped read-write in process {pid}"
            )
        self.pid, self.address, self.num_layers = pid, address, num_layers
        self._word = np.zeros(1, np.uint64)
        self._local = _iovecs(np.array([self._word.ctypes.data], np.uint64), _EIGHT)
        try:  # ptrace permission shows here, at registration, not mid-load
            _transfer("gather", pid, self._local, self._remote(0))
        except CopyFailed as e:
            raise InvalidRequest(f"layer_signals.pid: {e}") from None
        self._pidfd = _pidfd_open(pid)

    def _remote(self, layer: int) -> np.ndarray:
        return _iovecs(np.array([self.address + 8 * layer], np.uint64), _EIGHT)

    def signal(self, layer: int, seq: int) -> None:
        if _exited(self._pidfd):
            raise CopyFailed(f"layer signal: engine process {self.pid} is gone")
        self._word[0] = seq
        _transfer("scatter", self.pid, self._local, self._remote(layer))

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


_EIGHT = np.array([8], np.uint64)
