"""The L1 pool kept beyond the server (--pool-file): its bytes in a sealed memfd
that a keeper process holds at PATH, a unix socket (pegaflow.cache.pool_keeper;
the server's side: pegaflow.cache.pool_claim). A regular pool file at PATH, as
servers before 2026-12-05 kept it, is adopted once (pegaflow.cache.pool_adopt).

Layout: a superblock (format version and geometry), a slot header table (one
row per 4 KiB granule of the data region: the row of a slot is the granule its
first byte lies in, so slots of at least a granule never share a row), then the
data region itself, aligned to the page size. What the rows say, and when, is
pegaflow.cache.slot_log's; what a restarted server rebuilds from them is
pegaflow.server.warm_restart's.

One server per pool: the keeper hands it to one connection at a time, held
while the mapping lives.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pegaflow.common.settings import OnMismatch

from .pool_claim import (
    FLAG,
    Claim,
    PoolFileError,
    Watch,
    check_socket,
    claim,
    new_memfd,
    publish,
    swap,
)
from .pool_keeper import check_socket_path

logger = logging.getLogger(__name__)


MAGIC = b"PEGAPOOL"
# The slot checksum's algorithm is part of the format (pegaflow.cache.slot_log): a
# file of another version is never read, only refused or reinitialised.
VERSION = 3
FORMATS = {
    1: "blake3 slot checksums",
    2: "xxh3-64 slot checksums",
    3: "xxh3-64 slot checksums, state words 12 bits apart",
}
GRANULE = 4096  # data bytes per header row; smaller slots are not recorded
# magic, version, row bytes, granule, data bytes, slab bytes, data offset, pid
_SUPER = struct.Struct("<8sIIIQQQI")
SUPER_BYTES = 4096

# A row's state word lies outside its checksum, and decides whether the
# checksum is compared at all (a LANDED row is trusted without one). Any two
# states differ in at least 12 of their 32 bits: damage turns a word into
# none of them (the row is dropped), never into another state (format 2's
# 0..3 were one bit apart: a SEALED row flipped to LANDED skipped its check;
# a FREE row flipped to LANDED served a freed slot's stale bytes). FREE stays
# 0: a new pool's rows are zeros.
FREE, WRITING, LANDED, SEALED = 0, 0x3A5C96E1, 0xC5A3691E, 0x5AC3E196
STATES = (FREE, WRITING, LANDED, SEALED)
# A pool of format 2 (states 0..3 in this order) is kept: its rows' words are
# rewritten in place when it is mapped (_migrate_states).
MIGRATES = {2: (0, 1, 2, 3)}
# state, gen and checksum first: the checksum covers the rest of the row
# (pegaflow.cache.slot_log.META) and the slot's bytes.
_FIELDS = np.dtype(
    [
        ("state", "<u4"),
        ("gen", "<u4"),
        ("checksum", "<u8"),
        ("offset", "<u8"),  # of the slot in the data region
        ("slot_bytes", "<u8"),
        ("digest", "u1", (16,)),  # namespace name + geometry (gds namespace_digest)
        ("hash", "u1", (64,)),
        ("hash_len", "u1"),
        ("shard", "<u2"),
        ("shards", "<u2"),
        ("num_layers", "<u2"),
    ],
    align=True,
)
ROW_BYTES = 128
META_OFFSET = 16  # the checksum covers the row from here on, and the slot
ROW = np.dtype(
    {
        "names": _FIELDS.names,
        "formats": [_FIELDS.fields[n][0] for n in _FIELDS.names],
        "offsets": [_FIELDS.fields[n][1] for n in _FIELDS.names],
        "itemsize": ROW_BYTES,
    }
)


NOT_A_POOL = "not a pool"  # verdict(): bytes that are no pool, never overwritten


@dataclass(frozen=True, slots=True)
class Geometry:
    data_bytes: int
    slab_bytes: int
    align: int  # 4 KiB, or 2 MiB with --use-hugepages (a hugetlb memfd)

    @property
    def rows(self) -> int:
        return self.data_bytes // GRANULE

    @property
    def data_offset(self) -> int:
        head = SUPER_BYTES + self.rows * ROW_BYTES
        return -(-head // self.align) * self.align

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.data_bytes


class PoolFile:
    """The pool claimed from its keeper and mapped. `fresh`: its rows are all
    FREE (a new or reinitialised pool); otherwise they are what the last
    server left. room(): raises when a new pool's memory is not there (a kept
    one is resident already)."""

    def __init__(
        self,
        path: str,
        geometry: Geometry,
        on_mismatch: OnMismatch,
        room: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.geometry = geometry
        self._room = room
        held, self.fresh = self._acquire(on_mismatch)
        self.fd = held.fd
        try:
            self.mmap = mmap.mmap(
                self.fd,
                geometry.file_bytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
            version = _SUPER.unpack_from(self.mmap)[1]
            if version in MIGRATES:
                _migrate_states(self.mmap, geometry, version)
            self.mmap[: _SUPER.size] = self.superblock()  # this server's pid
        except BaseException:
            os.close(self.fd)
            held.sock.close()
            raise
        self.table = np.ndarray(
            geometry.rows, ROW, buffer=self.mmap, offset=SUPER_BYTES
        )
        self.data = np.ndarray(
            geometry.data_bytes, np.uint8, self.mmap, geometry.data_offset
        )
        self._watch = Watch(held, path, self.fd)

    def _acquire(self, on_mismatch: OnMismatch) -> tuple[Claim, bool]:
        path = self.path
        try:  # before anything: an old file adopted, then no keeper, was lost
            check_socket_path(path)
        except OSError as exc:
            raise PoolFileError(f"{FLAG}: {path}: {exc}; name a shorter path") from None
        try:
            st: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise PoolFileError(f"{FLAG}: cannot use {path}: {exc}") from exc
        if st is None:
            return publish(path, self.new_pool()), True
        if stat.S_ISREG(st.st_mode):
            return self._adopt(on_mismatch)
        if stat.S_ISLNK(st.st_mode):
            raise PoolFileError(
                f"{FLAG}: {path} is a symbolic link; name the path itself"
            )
        if not stat.S_ISSOCK(st.st_mode):
            raise PoolFileError(
                f"{FLAG}: {path} is neither a pool keeper's socket nor a pool "
                "file; name another path"
            )
        check_socket(path, st)
        held = claim(path)
        if held is None:  # its keeper was killed while no server held the pool
            logger.warning("%s: no keeper at %s; starting an empty pool", FLAG, path)
            return publish(path, self.new_pool()), True
        why = self.verdict(held.fd, os.fstat(held.fd).st_size)
        if why is None:
            return held, False
        try:
            self.refuse_or_warn(on_mismatch, why or "it holds no pool")
            fd = self.new_pool()
            try:
                swap(held, fd, path)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            os.close(held.fd)
            held.sock.close()
            raise
        os.close(held.fd)  # the old pool: freed once the keeper dropped it
        return Claim(held.sock, fd, held.keeper_pid, held.ino), True

    def _adopt(self, on_mismatch: OnMismatch) -> tuple[Claim, bool]:
        """An old pool file at PATH (servers before 2026-12-05), once: its
        bytes copied into a new memfd, whose keeper's socket replaces it."""
        from .pool_adopt import copy_old, open_old

        g, path = self.geometry, self.path
        fd = open_old(path)
        try:
            size = os.fstat(fd).st_size
            why = self.verdict(fd, size)
            if why == NOT_A_POOL:
                raise PoolFileError(
                    f"{FLAG}: {path} is not a pool file ({size} B, no PEGAPOOL "
                    "superblock); name a new path or an old pool file"
                )
            if why:
                self.refuse_or_warn(on_mismatch, why)
            mem = self.new_pool(allocate=why is not None)
            try:
                if why is None:
                    logger.warning(
                        "%s: adopting the pool file %s into a sealed memfd "
                        "(once; PATH becomes its keeper's socket)",
                        FLAG,
                        path,
                    )
                    copy_old(fd, mem, g.data_offset, g.file_bytes, self._tear)
                return publish(path, mem), why is not None
            except BaseException:
                os.close(mem)
                raise
        finally:
            os.close(fd)

    def _tear(self, src: int) -> None:
        """An old file's LANDED rows (trusted without a checksum) become
        WRITING before its bytes are given back chunk by chunk: a crash midway
        then loses blocks at the next adoption, never serves zeroes."""
        g = self.geometry
        with mmap.mmap(src, g.data_offset) as m:
            version = _SUPER.unpack_from(m)[1]
            _, writing, landed, _ = MIGRATES.get(version, STATES)
            rows = np.ndarray(g.rows, ROW, buffer=m, offset=SUPER_BYTES)
            state = rows["state"]
            state[state == landed] = writing
            del rows, state

    def new_pool(self, allocate: bool = True) -> int:
        """A new sealed memfd of this geometry, rows FREE, its superblock
        written (allocate=False: neither; an adoption fills it chunk by chunk)."""
        g = self.geometry
        if not allocate:
            return new_memfd(g.file_bytes, g.align, allocate=False)
        if self._room is not None:
            self._room()
        fd = new_memfd(g.file_bytes, g.align)
        with mmap.mmap(fd, g.file_bytes) as m:
            m[: _SUPER.size] = self.superblock()
        return fd

    def verdict(self, fd: int, size: int) -> str | None:
        """None: a pool of this geometry and format; otherwise why not ("" for
        an empty file, NOT_A_POOL for bytes that are no pool at all)."""
        g = self.geometry
        found = _read_super(fd, size)
        want = (VERSION, ROW_BYTES, GRANULE, g.data_bytes, g.slab_bytes, g.data_offset)
        if found is not None and found[0] in MIGRATES and found[1:] == want[1:]:
            found = want  # kept: its state words are rewritten when mapped
        if found == want and size == g.file_bytes:
            return None
        if found == want:  # ours, cut short (or grown) since
            return (
                f"it is truncated to {size} B (or grown: this pool needs "
                f"{g.file_bytes} B)"
            )
        if found is not None:
            version, _, _, data, slab, _ = found
            return (
                f"it holds a pool of format {_format(version)}, {data} B in slabs "
                f"of {slab} B; this server needs format {_format(VERSION)}, "
                f"{g.data_bytes} B in slabs of {g.slab_bytes} B"
            )
        if size == 0:
            return ""
        if _magic_cut(fd, size):
            return f"it is truncated to {size} B, inside its superblock"
        return NOT_A_POOL

    def refuse_or_warn(self, on_mismatch: OnMismatch, why: str) -> None:
        if on_mismatch == "refuse":
            raise PoolFileError(
                f"{FLAG}: {self.path}: {why}; start with the same --pool-size "
                "(and a server of that format), pass --pool-on-mismatch reinit "
                "to start it afresh, or name another path"
            )
        logger.warning("pool file %s: %s; reinitialising it", self.path, why)

    def superblock(self) -> bytes:
        g = self.geometry
        return _SUPER.pack(
            MAGIC,
            VERSION,
            ROW_BYTES,
            GRANULE,
            g.data_bytes,
            g.slab_bytes,
            g.data_offset,
            os.getpid(),
        )

    def close(self) -> None:
        """Unmaps and lets the keeper hand the pool to the next server."""
        if self.fd < 0:
            return
        del self.table, self.data
        try:
            self.mmap.close()
        except BufferError:  # a view is still alive; the OS unmaps it at exit
            logger.debug("pool file mapping still referenced at close")
        self._watch.close()
        os.close(self.fd)
        self.fd = -1


def _migrate_states(m: mmap.mmap, geometry: Geometry, version: int) -> None:
    """The rows of a pool of an older format whose only difference is its
    state words (MIGRATES), rewritten to this format's, before the
    superblock says this format. Idempotent: a crash midway leaves the old
    superblock over rows partly rewritten, and the next start rewrites the
    rest (this format's words are none of the old ones). A word of neither
    format stays as it is: the restart drops its row as damaged."""
    rows = np.ndarray(geometry.rows, ROW, buffer=m, offset=SUPER_BYTES)
    state = rows["state"]
    old = state.copy()
    new = old.copy()
    for was, now in zip(MIGRATES[version], STATES, strict=True):
        new[old == was] = now
    state[:] = new
    logger.warning(
        "%s: pool of format %s kept as format %s (%d rows in use)",
        FLAG,
        _format(version),
        _format(VERSION),
        int(np.count_nonzero(new)),
    )
    del rows, state


def _format(version: int) -> str:
    name = FORMATS.get(version)
    return f"{version} ({name})" if name else str(version)


def _magic_cut(fd: int, size: int) -> bool:
    """A file shorter than a superblock that starts as one: a pool file cut
    inside its first page, not somebody else's file."""
    head = os.pread(fd, min(size, len(MAGIC)), 0)
    return 0 < size < _SUPER.size and head == MAGIC[: len(head)] and len(head) >= 4


def _read_super(fd: int, size: int) -> tuple[int, int, int, int, int, int] | None:
    if size < _SUPER.size:
        return None
    magic, version, row_bytes, granule, data, slab, offset, _ = _SUPER.unpack(
        os.pread(fd, _SUPER.size, 0)
    )
    if magic != MAGIC:
        return None
    return version, row_bytes, granule, data, slab, offset
