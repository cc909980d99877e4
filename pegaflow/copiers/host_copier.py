"""Host copy engine: moves KV bytes between engines' CPU memory and the pool.

An engine whose KV cache lives in host memory registers (pid, address, size)
regions. The server then copies with process_vm_readv / process_vm_writev, which
take a whole scatter list per syscall: descriptor tables are bounds-checked,
coalesced and turned into iovec arrays with numpy, never a Python loop per block.
Calls are spread over a few threads because one syscall copies on one core (and
ctypes releases the GIL around it).

The syscalls themselves and their iovec helpers live in pegaflow.copiers.vm.

An engine that also shared its KV memory as a sealed memfd (share(); the
unix socket's share frame) is mapped into the server: runs inside that
mapping are copied with memcpy (pegaflow.copiers.shared_kv, run_copy), the
rest (a tensor's partial first and last pages, which stay the engine's
private memory) with process_vm_* as before. Every check of a copy (bounds,
deadline, a process that exited or exec'd) holds for both.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from pegaflow.common.errors import (
    CopyFailed,
    InternalError,
    InvalidRequest,
    PermissionDenied,
)
from pegaflow.common.geometry import Transfers
from pegaflow.common.pidfds import ProcessImage, exited
from pegaflow.common.runs import merge_adjacent
from pegaflow.common.share_frames import ShareSpan
from pegaflow.common.thread_creds import EngineIds

from .engine_lane import EngineLane, Threads
from .run_copy import copy_layers, copy_runs, layer_loop, run_loop
from .shared_kv import SharedKV
from .vm import (
    IOV_MAX,
    Direction,
    check_access,
    file_backed,
    first_outside,
    iovecs,
    merge_spans,
    read_maps,
    rw_spans,
    transfer,
)

logger = logging.getLogger(__name__)

PARALLEL_MIN_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class HostRegions:
    """Memory of one engine process that the server may copy to and from."""

    pid: int
    bases: tuple[int, ...]
    sizes: tuple[int, ...]
    # The process itself (its pidfd), not its number: once it exits, a new
    # process that reuses the pid can never receive this engine's copies;
    # and the program it ran when checked: once it exec's another (a setuid
    # one, say), no copy reaches that program's memory.
    image: ProcessImage | None = None
    # The user it ran as then (the image's), whose rights every copy's system
    # call acts with: the kernel then refuses, in the call, a program the
    # process exec'd after the image's last check (a setuid one, say).
    ids: EngineIds | None = None
    # The regions merged into sorted spans, for every copy's bounds check.
    spans: tuple[np.ndarray, np.ndarray] = field(init=False)
    # The engine's memfd mapped into the server, once it shared one.
    shared: SharedSlot = field(init=False)
    # The threads its process_vm copies run on (pegaflow.copiers.engine_lane).
    lane: EngineLane = field(init=False)
    helpers: int = 1

    def __post_init__(self) -> None:
        if self.ids is None and self.image is not None:
            object.__setattr__(self, "ids", self.image.ids)
        bases = np.array(self.bases, np.uint64)
        ends = bases + np.array(self.sizes, np.uint64)
        object.__setattr__(self, "spans", merge_spans(bases, ends))
        object.__setattr__(self, "shared", SharedSlot())
        object.__setattr__(self, "lane", EngineLane(f"vm{self.pid}", self.helpers))


class SharedSlot:
    """Set once, by the one share that claimed it, while copies may run: they
    read it once each."""

    __slots__ = ("kv", "signals_in_kv", "_claimed", "_lock")

    def __init__(self) -> None:
        self.kv: SharedKV | None = None
        self.signals_in_kv = False  # its layer signal words are written through kv
        self._claimed = False
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """Whether this caller is the one share to map (shares of one
        registration may arrive on two connections at once, each on its
        own thread: the second would map again, and the first mapping
        would be overwritten and never unmapped)."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def unclaim(self) -> None:
        """A share that failed: another may try."""
        with self._lock:
            self._claimed = False


def _coalesce(
    local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs where both sides continue exactly where the previous ended."""
    (local, remote), nbytes = merge_adjacent([local, remote], nbytes)
    return local, remote, nbytes


def _split(count: int, total_bytes: int, threads: int) -> list[slice]:
    """Even slices of at most IOV_MAX iovecs; at least `threads` if large."""
    if count <= IOV_MAX and total_bytes < PARALLEL_MIN_BYTES:
        return [slice(0, count)]
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
        # Opened before the checks: if it still lives after them, every check
        # below looked at the process (and program) it names, not a successor
        # that took over its pid, or a program it exec'd, meanwhile.
        image = ProcessImage(pid)
        try:
            return self._open_checked(pid, regions, image)
        except BaseException:
            image.close()
            raise

    def _open_checked(
        self, pid: int, regions: list[tuple[int, int]], image: ProcessImage
    ) -> HostRegions:
        if not regions:
            raise InvalidRequest("regions: at least one (address, size) is required")
        for i, (addr, size) in enumerate(regions):  # a handful, once per engine
            if addr < 0 or size <= 0 or addr + size > 1 << 64:
                raise InvalidRequest(
                    f"regions[{i}]: address {addr:#x} size {size} is not a range"
                )
        addr = np.array([a for a, _ in regions], np.uint64)
        size = np.array([s for _, s in regions], np.uint64)
        maps = read_maps(pid)
        bad = first_outside(*rw_spans(pid, maps), addr, size)
        if bad >= 0:
            a, s = regions[bad]
            raise InvalidRequest(
                f"regions[{bad}]: [{a:#x}, {a + s:#x}) is not mapped read-write "
                f"in process {pid}"
            )
        if (found := file_backed(pid, maps, addr, size)) is not None:
            bad, what = found
            a, s = regions[bad]
            raise InvalidRequest(
                f"regions[{bad}]: [{a:#x}, {a + s:#x}) maps {what}; the server "
                "copies host KV only from anonymous, shared (tmpfs, memfd) or "
                "hugetlbfs memory: a file's pages can stall the copy on I/O"
            )
        # Registration is the place to learn about ptrace permission, not the
        # first save; asked of the kernel without reading the engine's memory.
        try:  # as the engine's user, as every copy will
            check_access(pid, image.ids)
        except (CopyFailed, PermissionDenied) as e:
            raise InvalidRequest(f"pid: {e}") from None
        if exited(image.pidfd):
            raise InvalidRequest(f"pid: process {pid} exited while registering")
        if not image.complete:  # no exec could be seen
            raise InvalidRequest(f"pid: cannot open process {pid}'s memory")
        logger.debug(
            "open pid=%d: %d region(s), %d bytes", pid, len(regions), size.sum()
        )
        return HostRegions(
            pid,
            tuple(a for a, _ in regions),
            tuple(s for _, s in regions),
            image,
            helpers=self._threads - 1,
        )

    @staticmethod
    def lane_for(
        regions: HostRegions, t: Transfers, direction: str, layer_wise: bool
    ) -> EngineLane | None:
        """Where this copy must run, off the event loop and apart from every
        other engine's copies (pegaflow.copiers.engine_lane): the
        registration's lane when any of it calls process_vm_* (a run outside
        the shared memfd, or a layer signal word written that way); None when
        it is all memcpy in the server's own mapping, which cannot stall.
        direction: "save" (engine -> pool) or "load"; layer_wise: it writes
        the layer signal words."""
        kv = regions.shared.kv
        if kv is None or (layer_wise and not regions.shared.signals_in_kv):
            return regions.lane
        remote = t.src if direction == "save" else t.dst  # the engine's side
        _, inside = kv.translate(
            np.asarray(remote, np.uint64), np.asarray(t.nbytes, np.uint64)
        )
        return None if inside.all() else regions.lane

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
            self.event_done(regions, wait_event)
        self._copy("gather", regions, t.dst, t.src, t.nbytes, deadline)

    def event_done(self, regions: HostRegions, wait_event: int) -> bool:
        raise InvalidRequest("wait_event: host engines have no CUDA events")

    def scatter(
        self, regions: HostRegions, t: Transfers, deadline: float | None = None
    ) -> None:
        """Local -> engine: t.src is ours, t.dst lies in the engine process."""
        self._copy("scatter", regions, t.src, t.dst, t.nbytes, deadline)

    def scatter_layers(
        self,
        regions: HostRegions,
        t: Transfers,
        edges: np.ndarray,
        signals: object,
        seq: int,
        deadline: float | None = None,
    ) -> bool:
        """A layer-wise load in one call (pegaflow.copiers.run_copy.copy_layers)
        where every run and every signal word lies in the engine's shared
        mapping; False, having done nothing, where not (the caller goes
        layer by layer). t is sorted by layer: layer l is edges[l]..edges[l + 1]."""
        kv = regions.shared.kv
        words_of = getattr(signals, "shared_words", None)
        words = None if words_of is None else words_of()
        if kv is None or words is None or len(edges) != len(words) + 1:
            return False
        n = np.asarray(t.nbytes, np.uint64)
        remote = np.asarray(t.dst, np.uint64)
        self._check_bounds("scatter", regions, remote, n)
        there, inside = kv.translate(remote, n)
        if not inside.all():
            return False
        if regions.image is not None:  # as _copy: the last check before it
            regions.image.check("scatter")
        src = np.asarray(t.src, np.uint64)
        if logger.isEnabledFor(logging.DEBUG):
            msg = "scatter: %d layers in one call, %d runs, %d bytes"
            logger.debug(msg, len(words), len(n), int(n.sum()))
        copy_layers(there, src, n, edges, words, seq, "scatter", deadline)
        self._check_after("scatter", regions)
        return True

    def share(
        self,
        regions: HostRegions,
        fd: int,
        spans: tuple[ShareSpan, ...],
        signals: object = None,
    ) -> int:
        """Map the engine's memfd (checked: pegaflow.copiers.shared_kv); copies
        inside its spans are memcpy from now on. The bytes mapped. Off the
        event loop: it reads the engine's maps and may compile. signals: the
        worker's layer signal words (pegaflow.copiers.layer_signals), which
        the memfd may hold too; they are then written through the mapping."""
        if not regions.shared.claim():
            raise InvalidRequest(
                f"share: process {regions.pid}'s registration already shares "
                "its memory (or another share of it is under way); register "
                "again to share another memfd"
            )
        try:
            return self._map_shared(regions, fd, spans, signals)
        except BaseException:
            if regions.shared.kv is None:  # nothing mapped: another may try
                regions.shared.unclaim()
            raise

    def _map_shared(
        self,
        regions: HostRegions,
        fd: int,
        spans: tuple[ShareSpan, ...],
        signals: object,
    ) -> int:
        # Compiled (or loaded from numba's cache) now, once, on this thread:
        # not at start-up, so a server no CPU engine shares with never
        # imports numba for it (~100 MiB), and not in the first copy's time.
        run_loop()
        words = getattr(signals, "span", None)
        if words is not None and getattr(signals, "pid", None) == regions.pid:
            layer_loop()
        else:
            words = None
        kv = SharedKV(fd, spans, regions.pid, regions.spans, words)
        try:  # the maps read were of the registered process and program
            if regions.image is not None:
                regions.image.check("share")
        except BaseException:
            kv.close()
            raise
        regions.shared.kv = kv
        # The words may lie outside the memfd (a connector that shares only
        # its KV): then they are still written with process_vm_writev, and
        # a layer-wise load must keep to the registration's lane.
        in_kv = words is not None and signals.attach(kv)  # type: ignore[union-attr]
        regions.shared.signals_in_kv = bool(in_kv)
        logger.info(
            "pid %d shares %d B of KV memory (%d span(s))",
            regions.pid,
            kv.nbytes,
            len(spans),
        )
        return kv.nbytes

    def close(self, regions: HostRegions) -> None:
        """After the last copy: the shared mapping and the process's handles go."""
        kv, regions.shared.kv = regions.shared.kv, None
        regions.lane.close()
        if kv is not None:
            kv.close()
        if regions.image is not None:
            regions.image.close()
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
        if not n.all():  # empty iovecs would only complicate resuming
            keep = n > 0
            local, remote, n = local[keep], remote[keep], n[keep]
        if not n.size:
            return
        # Gone, or another program (exec) or other rights since registering:
        # the last check before the copies (the calls name it by its pid).
        if regions.image is not None:
            regions.image.check(op)
        kv = regions.shared.kv
        pool = self._parts_pool(regions)
        if kv is not None:
            local, remote, n = self._copy_shared(
                op, kv, local, remote, n, deadline, pool
            )
        if n.size:
            local, remote, n = _coalesce(local, remote, n)
            self._copy_vm(op, regions, local, remote, n, deadline, pool)
        self._check_after(op, regions)

    def _copy_shared(
        self,
        op: Direction,
        kv: SharedKV,
        local: np.ndarray,
        remote: np.ndarray,
        n: np.ndarray,
        deadline: float | None,
        pool: ThreadPoolExecutor | Threads | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copy the runs inside the engine's shared mapping; the rest's
        (local, remote, n) are left for process_vm. Runs are sorted out as
        they came, the ones lane_for judged, and merged only afterwards, on
        each side of the split: two runs in adjacent spans merged first
        would make one that no span holds, read by process_vm on a thread
        lane_for had cleared (the event loop, for a small copy)."""
        mapped, inside = kv.translate(remote, n)
        if inside.any():
            here, there, k = _coalesce(local[inside], mapped[inside], n[inside])
            dst, src = (here, there) if op == "gather" else (there, here)
            total = int(k.sum())
            parts = self._threads if total >= PARALLEL_MIN_BYTES else 1
            if logger.isEnabledFor(logging.DEBUG):
                msg = "%s: memcpy %d runs, %d bytes, %d part(s)"
                logger.debug(msg, op, len(k), total, parts)
            copy_runs(dst, src, k, op, deadline, pool, parts)
        if inside.all():
            return local[:0], remote[:0], n[:0]
        out = ~inside
        return local[out], remote[out], n[out]

    def _copy_vm(
        self,
        op: Direction,
        regions: HostRegions,
        local: np.ndarray,
        remote: np.ndarray,
        n: np.ndarray,
        deadline: float | None,
        pool: ThreadPoolExecutor | Threads | None,
    ) -> None:
        liov, riov = iovecs(local, n), iovecs(remote, n)
        total = int(n.sum())
        parts = _split(len(n), total, self._threads)
        if logger.isEnabledFor(logging.DEBUG):
            msg = "%s pid=%d: %d iovecs, %d call(s), %d bytes"
            logger.debug(msg, op, regions.pid, len(n), len(parts), total)
        # Each call acts as the engine's user (every thread switches for its
        # own call and back), so the kernel refuses, in the call itself, a
        # program exec'd since the image's check with rights the user lacks.
        pid, ids = regions.pid, regions.ids
        if pool is None or len(parts) == 1:
            for part in parts:
                transfer(op, pid, liov[part], riov[part], deadline, ids=ids)
            return
        # The calling thread copies the last part itself: one hand-off to
        # a pool thread and back fewer (each needs the GIL on its way,
        # which an SSD writer may hold), and no thread idle meanwhile.
        futures = [
            pool.submit(transfer, op, pid, liov[p], riov[p], deadline, ids=ids)
            for p in parts[:-1]
        ]
        try:
            last = parts[-1]
            transfer(op, pid, liov[last], riov[last], deadline, ids=ids)
        finally:
            wait(futures)  # never return while a chunk still writes
        for f in futures:
            f.result()

    def _parts_pool(self, regions: HostRegions) -> ThreadPoolExecutor | Threads | None:
        """A copy on its registration's lane splits onto that lane's helpers:
        a part stalled in the engine's memory holds no thread of the shared
        pool, which copies for every other engine."""
        if regions.lane.runner.owns_current_thread():
            return regions.lane.helpers
        return self._pool

    @staticmethod
    def _check_after(op: Direction, regions: HostRegions) -> None:
        # The calls name the process by its pid. An engine that exited during
        # them may have handed that pid on, so what a save read may be another
        # process's memory: never published (and a load's failure is reported).
        # One that exec'd meanwhile: what a save read may be the new program's
        # (never published); a load reached it only if the program holds no
        # rights the engine's user lacks (the kernel refused it otherwise).
        # Through a shared mapping the bytes are the engine's memfd's, but an
        # engine gone or changed since is no engine to publish or load for.
        image = regions.image
        if image is not None and exited(image.pidfd):
            raise CopyFailed(f"{op}: engine process {regions.pid} exited mid-copy")
        if image is not None and op == "gather":
            image.check(op)

    @staticmethod
    def _check_bounds(
        op: Direction, regions: HostRegions, remote: np.ndarray, n: np.ndarray
    ) -> None:
        bad = first_outside(*regions.spans, remote, n)
        if bad >= 0:
            field = "src" if op == "gather" else "dst"
            a, s = int(remote[bad]), int(n[bad])
            raise InternalError(
                f"transfers.{field}[{bad}]: [{a:#x}, {a + s:#x}) is outside the "
                f"regions registered for process {regions.pid}"
            )
