"""Back a host engine's KV memory with one sealed memfd, for the server to map
(pegaflow.copiers.shared_kv): a load into it is then a memcpy in the server,
not a process_vm_writev that pins each of the engine's pages under its mmap
lock (the lock the engine's own allocations take every step).

For each registered region, the whole anonymous pages inside it are copied
into the file and the file is mapped over them (MAP_SHARED | MAP_FIXED), a
chunk at a time (a chunk's old pages are freed as the next is copied: the engine never
holds much more memory than before). Addresses stay the same, so the tensor,
every view of it and every pointer vLLM's kernels hold stay valid.

A region's partial first and last pages are left alone: their other bytes
belong to the allocator (glibc keeps a chunk's header just before it) or to
other allocations, which another thread may write while a page is copied and
remapped, and which the server has no business seeing. The few KV bytes on
those pages stay on the process_vm path (the server splits runs by span),
as do pages some other file backs (share_memory says which).

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
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from pegaflow.common.memfd import SEALS, map_shared
from pegaflow.common.share_frames import ShareSpan

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
CHUNK_BYTES = 64 << 20  # copied and remapped at a time


# Equal only to itself: the registry's WeakSet keeps one of equal members, and
# a handout can equal a closed one not yet collected (the descriptor number
# reused, the same spans); the memfd then counted as unused once that one went.
@dataclass(frozen=True, slots=True, weakref_slot=True, eq=False)
class SharedMemory:
    """The memfd (kept open: every registration, after a server restart too,
    hands it over again) and what of this process's memory it backs. Its
    pages count as in use while this object lives (share_memory)."""

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


# The memfds this process mapped over its memory, by inode: the descriptor,
# kept open while any of its pages are still mapped here, and the
# SharedMemory objects handed out for it that still live. Two workers of one
# process (pipeline stages, hybrid groups, tests) may name the same pages,
# and an engine's buffer may land on pages a freed one left mapped from its
# memfd. A page backed by a memfd in use is never mapped over again: a live
# registration's server mapping relies on it (a remap would leave that
# mapping looking at pages the engine no longer uses: its loads would
# vanish, its saves read stale bytes). A memfd no SharedMemory uses any more
# is memory like any other.
_lock = threading.Lock()
_held: dict[int, tuple[int, weakref.WeakSet[SharedMemory]]] = {}


@dataclass(frozen=True, slots=True)
class _Piece:
    """Part of a page range and what backs it now."""

    address: int
    size: int
    inode: int  # a memfd of ours in use, or 0
    offset: int  # in that memfd
    fresh: bool  # anonymous or unused: free to move into a new memfd


def share_memory(
    regions: Sequence[tuple[int, int]], name: str = "pegaflow-kv"
) -> SharedMemory | None:
    """Back the whole pages of `regions` (this process's memory) with one
    sealed memfd; None where there are none or the kernel refuses (the
    memory then stays as it was, or partly remapped with the same bytes).

    Pages a memfd in use backs are never remapped. The most bytes win: the
    free pages (anonymous, or a memfd's no SharedMemory uses), moved into a
    new memfd, or the pages one memfd in use backs, handed over again (its
    own descriptor). The rest (and pages any other file backs) are left
    out: the server reaches them through process_vm (it splits runs by
    span)."""
    pages = whole_pages(regions)
    if not pages:
        return None
    with _lock:
        maps = _memory_maps()
        _forget_unmapped(maps)
        pieces = [p for addr, size in pages for p in _pieces(addr, size, maps)]
        fresh = _merged([(p.address, p.size) for p in pieces if p.fresh])
        by_inode: dict[int, list[_Piece]] = {}
        for p in pieces:
            if p.inode:
                by_inode.setdefault(p.inode, []).append(p)
        held = {i: sum(p.size for p in ps) for i, ps in by_inode.items()}
        inode = max(held, key=held.__getitem__, default=0)
        if fresh and sum(n for _, n in fresh) >= held.get(inode, 0):
            shared = _share_new(fresh, name)
            if shared is not None:
                users: weakref.WeakSet[SharedMemory] = weakref.WeakSet([shared])
                _held[os.fstat(shared.fd).st_ino] = (os.dup(shared.fd), users)
            return shared
        if not inode:
            return None
        fd, users = _held[inode]
        spans = tuple(ShareSpan(p.address, p.offset, p.size) for p in by_inode[inode])
        shared = SharedMemory(os.dup(fd), spans)
        users.add(shared)
        return shared


# (start, end, inode, file offset, kind) of this process's mappings, sorted.
_Map = tuple[int, int, int, int, str]


def _memory_maps() -> list[_Map]:
    """kind: "ours" (a shared mapping of a memfd in _held), "anon" (private
    or shared anonymous memory), "other" (any other file). An "ours" in use
    is "live"."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            inode, path = int(parts[4]), parts[5].strip() if len(parts) > 5 else ""
            shared = parts[1][3] == "s"
            if shared and inode in _held and path.startswith("/memfd:"):
                kind = "live" if _held[inode][1] else "ours"
            elif inode == 0 or (shared and path == "/dev/zero (deleted)"):
                kind = "anon"
            else:
                kind = "other"
            out.append((lo, hi, inode, int(parts[2], 16), kind))
    return out


def _forget_unmapped(maps: list[_Map]) -> None:
    """Close the memfds no page of this process is mapped from any more."""
    mapped = {inode for _, _, inode, _, kind in maps if kind in ("ours", "live")}
    for inode in [i for i in _held if i not in mapped]:
        os.close(_held.pop(inode)[0])


def _pieces(addr: int, size: int, maps: list[_Map]) -> list[_Piece]:
    """[addr, addr + size) split by what backs it; unmapped gaps are left
    out (nothing to share there)."""
    out = []
    end = addr + size
    for lo, hi, inode, offset, kind in maps:
        a, b = max(lo, addr), min(hi, end)
        if a >= b:
            continue
        live = kind == "live"
        out.append(
            _Piece(
                a,
                b - a,
                inode if live else 0,
                offset + (a - lo) if live else 0,
                kind in ("anon", "ours"),
            )
        )
    return out


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent (address, size) runs joined (runs in address order)."""
    out: list[tuple[int, int]] = []
    for addr, size in runs:
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((addr, size))
    return out


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
