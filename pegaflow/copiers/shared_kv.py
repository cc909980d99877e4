"""A host engine's KV memory mapped into the server from a sealed memfd.

A CPU engine that backs its KV tensors with a memfd (pegaflow.client.host_share)
hands the file to the server over the unix socket; the server checks it and
maps it once, and from then on a copy into or out of those bytes is a plain
memcpy in the server (pegaflow.copiers.run_copy): no process_vm_* call, so
no pinning of the engine's pages under its mmap lock while it allocates, and
no switch to the engine's credentials per call. What the server can reach
through the mapping is exactly the bytes the engine put in the file.

Checks, once, before anything is mapped (each refusal names the field):
- the descriptor is a memfd (its name, and the kernel answers F_GET_SEALS,
  which only shmem files do), on 4 KiB pages (a hugetlbfs memfd can SIGBUS
  the server on a hole when huge pages run out), every page populated;
- it is sealed against shrinking and growing, and the seals are sealed: the
  engine can never truncate the file under the server's mapping (a SIGBUS),
  and not sealed against writes (the server's loads write);
- every span is page aligned, inside the file, inside the regions the
  engine registered or on the pages of its layer signal words (where the
  bounds checks of every copy already keep each KV run), disjoint from the
  others;
- the engine maps the file there: /proc/<pid>/maps shows the file's device
  and inode, shared and read-write, at the span's offset. (What the engine
  maps there later is its own business: it can only make its own loads
  land elsewhere in its own file.)
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat

import numpy as np

from pegaflow.common.errors import InvalidRequest
from pegaflow.common.memfd import SEALS, map_shared, unmap
from pegaflow.common.share_frames import ShareSpan

from .vm import first_outside, merge_spans, read_maps

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


class SharedKV:
    """One engine's memfd, mapped read-write into the server; close() unmaps."""

    def __init__(
        self,
        fd: int,
        spans: tuple[ShareSpan, ...],
        pid: int,
        region_spans: tuple[np.ndarray, np.ndarray],
        signal_words: tuple[int, int] | None = None,
    ) -> None:
        """signal_words: (address, bytes) of the worker's layer signal words,
        whose pages a span may cover too (the engine's loads wait on them)."""
        st = check_memfd(fd)
        if signal_words is not None:
            region_spans = with_pages_of(region_spans, *signal_words)
        check_spans(spans, st.st_size, region_spans)
        check_engine_maps(pid, spans, st)
        self.size = max(s.offset + s.size for s in spans)
        # Populated now, once: a copy never takes a page fault per 4 KiB
        # page of the engine's KV (~6,000 for a 24 MB load) on its first touch.
        try:
            base = map_shared(fd, self.size)
        except OSError as exc:
            why = os.strerror(exc.errno or 0)
            raise InvalidRequest(f"share.fd: cannot map it ({why})") from None
        self.base: int | None = base
        order = sorted(spans, key=lambda s: s.address)
        self.starts = np.array([s.address for s in order], np.uint64)
        self.ends = self.starts + np.array([s.size for s in order], np.uint64)
        # Engine address -> server address: add the span's shift (mod 2**64).
        local = np.array([base + s.offset for s in order], np.uint64)
        self.shift = local - self.starts
        self.nbytes = int(sum(s.size for s in spans))

    def translate(
        self, remote: np.ndarray, nbytes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(server addresses, inside): inside[i] when [remote[i], +nbytes[i])
        lies within one span; the server address is valid only there."""
        i = np.searchsorted(self.starts, remote, side="right") - 1
        j = np.maximum(i, 0)
        inside = (
            (i >= 0) & (remote + nbytes <= self.ends[j]) & (remote >= self.starts[j])
        )
        return remote + self.shift[j], inside

    def close(self) -> None:
        """After the last copy through it (the worker's active_ops say when)."""
        if self.base is not None:
            unmap(self.base, self.size)
            self.base = None


def check_memfd(fd: int) -> os.stat_result:
    try:
        st = os.fstat(fd)
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise InvalidRequest(f"share.fd: not a usable descriptor ({exc})") from None
    if not stat.S_ISREG(st.st_mode) or not name.startswith("/memfd:"):
        raise InvalidRequest(f"share.fd: {name!r} is not a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise InvalidRequest(f"share.fd: no seals ({exc}); not a memfd") from None
    if seals & SEALS != SEALS:
        raise InvalidRequest(
            f"share.fd: seals {seals:#x} lack F_SEAL_SHRINK | F_SEAL_GROW | "
            "F_SEAL_SEAL: the engine could shrink the file under the server's "
            "mapping"
        )
    if seals & (fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)):
        raise InvalidRequest("share.fd: sealed against writes; loads write into it")
    if st.st_blksize != PAGE:
        raise InvalidRequest(
            f"share.fd: pages of {st.st_blksize} B (hugetlbfs?); only {PAGE} B "
            "pages are shared (a huge-page memfd can fault when none are free)"
        )
    if st.st_blocks * 512 < st.st_size:
        raise InvalidRequest(
            f"share.fd: {st.st_blocks * 512} of its {st.st_size} B are populated; "
            "write every byte before sharing it"
        )
    return st


def with_pages_of(
    spans: tuple[np.ndarray, np.ndarray], address: int, nbytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """The merged spans and the whole pages holding [address, +nbytes)."""
    lo = address // PAGE * PAGE
    hi = -(-(address + nbytes) // PAGE) * PAGE
    starts = np.append(spans[0], np.uint64(lo))
    ends = np.append(spans[1], np.uint64(hi))
    return merge_spans(starts, ends)


def check_spans(
    spans: tuple[ShareSpan, ...],
    file_size: int,
    region_spans: tuple[np.ndarray, np.ndarray],
) -> None:
    for i, s in enumerate(spans):
        if s.size <= 0 or (s.address | s.offset | s.size) % PAGE:
            raise InvalidRequest(
                f"share.spans[{i}]: address {s.address:#x} offset {s.offset} size "
                f"{s.size} is not a run of whole {PAGE} B pages"
            )
        if s.offset + s.size > file_size:
            raise InvalidRequest(
                f"share.spans[{i}]: [{s.offset}, {s.offset + s.size}) is past the "
                f"memfd's {file_size} B"
            )
    addr = np.array([s.address for s in spans], np.uint64)
    size = np.array([s.size for s in spans], np.uint64)
    bad = first_outside(*region_spans, addr, size)
    if bad >= 0:
        s = spans[bad]
        raise InvalidRequest(
            f"share.spans[{bad}]: [{s.address:#x}, {s.address + s.size:#x}) is "
            "outside the regions this worker registered"
        )
    if _overlap(addr, size):
        raise InvalidRequest("share.spans: spans overlap in the engine's memory")


def _overlap(addr: np.ndarray, size: np.ndarray) -> bool:
    order = np.argsort(addr)
    a, e = addr[order], (addr + size)[order]
    return bool((a[1:] < e[:-1]).any())


def check_engine_maps(
    pid: int, spans: tuple[ShareSpan, ...], st: os.stat_result
) -> None:
    """Every span is the engine's shared read-write mapping of this file at
    the span's offset, per /proc/<pid>/maps."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    maps = []  # (lo, hi, file offset) of the engine's mappings of the file
    for line in read_maps(pid, "share.fd"):
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[4] != str(st.st_ino) or parts[3] != dev:
            continue
        if not parts[1].startswith("rw") or parts[1][3] != "s":
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps.append((lo, hi, int(parts[2], 16)))
    for i, s in enumerate(spans):
        at, end = s.address, s.address + s.size
        for lo, hi, off in sorted(maps):
            if lo <= at < hi and off + (at - lo) == s.offset + (at - s.address):
                at = hi
            if at >= end:
                break
        if at < end:
            raise InvalidRequest(
                f"share.spans[{i}]: process {pid} does not map the memfd's "
                f"[{s.offset}, {s.offset + s.size}) shared read-write at "
                f"{s.address:#x} (first gap at {at:#x})"
            )
