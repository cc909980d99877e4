"""Back a host engine's KV memory with one sealed memfd, for the server to map
(pegaflow.copiers.shared_kv): a load into it is then a memcpy in the server,
not a process_vm_writev that pins each of the engine's pages under its mmap
lock (the lock the engine's own allocations take every step).

For each registered region, the whole pages inside it are copied into the
file and the file is mapped over them (MAP_SHARED | MAP_FIXED), a chunk at a
time (a chunk's old pages are freed as the next is copied: the engine never
holds much more memory than before). Addresses stay the same, so the tensor,
every view of it and every pointer vLLM's kernels hold stay valid.

A region's partial first and last pages are left alone: their other bytes
belong to the allocator (glibc keeps a chunk's header just before it) or to
other allocations, which another thread may write while a page is copied and
remapped, and which the server has no business seeing. The few KV bytes on
those pages stay on the process_vm path (the server splits runs by span).

Call it before the engine writes KV (at register_kv_caches): a write between
a chunk's copy and its remap would be lost. The file is sealed against
shrinking and growing, so the server's mapping can never SIGBUS.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pegaflow.common.memfd import SEALS, map_shared
from pegaflow.common.share_frames import ShareSpan

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
CHUNK_BYTES = 64 << 20  # copied and remapped at a time


@dataclass(frozen=True, slots=True)
class SharedMemory:
    """The memfd (kept open: every registration, after a server restart too,
    hands it over again) and what of this process's memory it backs."""

    fd: int
    spans: tuple[ShareSpan, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.spans)

    def close(self) -> None:
        """The descriptor only: the mappings keep the file while they last."""
        os.close(self.fd)


def whole_pages(regions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, size) of the whole pages inside each region, if any."""
    out = []
    for addr, size in regions:
        lo = -(-addr // PAGE) * PAGE
        hi = (addr + size) // PAGE * PAGE
        if hi > lo:
            out.append((lo, hi - lo))
    return out


# Every memfd this process mapped over its memory, with what it backs: two
# workers of one process (pipeline stages run side by side, tests) may name
# the same pages. Mapping a second memfd over them would leave the first
# one's server-side mapping looking at pages the engine no longer uses.
_lock = threading.Lock()
_backed: list[SharedMemory] = []


def share_memory(
    regions: Sequence[tuple[int, int]], name: str = "pegaflow-kv"
) -> SharedMemory | None:
    """Back the whole pages of `regions` (this process's memory) with one
    sealed memfd; None where there are none or the kernel refuses (the
    memory then stays as it was, or partly remapped with the same bytes).
    Pages another call backed already: that memfd again (its own
    descriptor), if it backs all of them."""
    pages = whole_pages(regions)
    if not pages:
        return None
    with _lock:
        _drop_stale()
        for known in _backed:
            spans = _within(known, pages)
            if spans is not None:
                return SharedMemory(os.dup(known.fd), spans)
        # Pages partly backed by an earlier memfd: memory that was freed and
        # reused but is still mapped from it (glibc's heap keeps a small
        # buffer's pages), as no live worker's regions overlap another's
        # only in part. A new memfd over them; the old entries are dropped.
        old = [known for known in _backed if _overlap(known, pages)]
        shared = _share_new(pages, name)
        if shared is not None:
            for known in old:
                _backed.remove(known)
                known.close()
            _backed.append(SharedMemory(os.dup(shared.fd), shared.spans))
        return shared


def _drop_stale() -> None:
    """Forget memfds no longer mapped where they were (the memory was freed
    and perhaps reused: its pages are not theirs any more)."""
    if not _backed:
        return
    mapped = _mapped_by_inode()
    keep = []
    for known in _backed:
        ranges = mapped.get(os.fstat(known.fd).st_ino, [])
        if all(_covered(s.address, s.size, ranges) for s in known.spans):
            keep.append(known)
        else:
            known.close()
    _backed[:] = keep


def _mapped_by_inode() -> dict[int, list[tuple[int, int]]]:
    """inode -> [start, end) of this process's shared mappings of memfds."""
    out: dict[int, list[tuple[int, int]]] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or "s" not in parts[1] or "/memfd:" not in parts[5]:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.setdefault(int(parts[4]), []).append((lo, hi))
    return out


def _covered(addr: int, size: int, ranges: list[tuple[int, int]]) -> bool:
    """[addr, addr + size) lies inside the union of `ranges`."""
    at, end = addr, addr + size
    for lo, hi in sorted(ranges):
        if lo <= at < hi:
            at = hi
        if at >= end:
            return True
    return at >= end


def _within(
    known: SharedMemory, pages: list[tuple[int, int]]
) -> tuple[ShareSpan, ...] | None:
    """`pages` as spans of `known`'s memfd, if it backs every one of them."""
    out = []
    for addr, size in pages:
        span = next(
            (
                s
                for s in known.spans
                if s.address <= addr and addr + size <= s.address + s.size
            ),
            None,
        )
        if span is None:
            return None
        out.append(ShareSpan(addr, span.offset + addr - span.address, size))
    return tuple(out)


def _overlap(known: SharedMemory, pages: list[tuple[int, int]]) -> bool:
    return any(
        s.address < addr + size and addr < s.address + s.size
        for s in known.spans
        for addr, size in pages
    )


def _share_new(pages: list[tuple[int, int]], name: str) -> SharedMemory | None:
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as exc:
        logger.info("pegaflow: no memfd (%s): KV stays on process_vm", exc)
        return None
    try:
        spans = _fill_and_map(fd, pages)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        os.close(fd)
        logger.warning("pegaflow: cannot share KV memory (%s): process_vm", exc)
        return None
    return SharedMemory(fd, spans)


def _fill_and_map(fd: int, pages: list[tuple[int, int]]) -> tuple[ShareSpan, ...]:
    os.ftruncate(fd, sum(n for _, n in pages))
    spans, offset = [], 0
    for addr, size in pages:
        for at in range(0, size, CHUNK_BYTES):
            n = min(CHUNK_BYTES, size - at)
            _copy_in(fd, addr + at, n, offset + at)
            # Populated: the engine's KV pages were all touched before (vLLM
            # zeroes its cache), and the forward should not fault on them now.
            map_shared(fd, n, offset + at, at=addr + at)
        spans.append(ShareSpan(addr, offset, size))
        offset += size
    return tuple(spans)


def _copy_in(fd: int, addr: int, n: int, offset: int) -> None:
    view = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
    done = 0
    while done < n:
        done += os.pwrite(fd, view[done:], offset + done)
