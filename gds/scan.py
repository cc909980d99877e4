"""Rebuild of the SSD index by scanning the data files, for a start whose journal
is missing, foreign or damaged.

Every record starts 4 KiB-aligned with a header page that names the store, the
block and the record's sequence number (format.py). The scan reads each file's
record area in large chunks on a few threads, finds the header pages of a chunk
with numpy (magic at a page start, then version, store id, hash length, bounds
and CRC-32 checked over all candidates at once) and checks each record's payload
against its checksum while the chunk is in memory, so a torn or damaged record
is dropped here rather than at its first load. A record that crosses a chunk
boundary is read again whole after the scan.

What survives is placed as the ring left it: where two records overlap, the
newer one (higher sequence number) overwrote the older one. Each ring's head is
the end of its newest record; a later write reclaims the records after it first,
as it would have without the restart. The scan reads the whole record area:
its time is the files' size over the disk's read rate, which is why the journal
is the normal way back. A chunk that cannot be read (a bad sector) is skipped,
its records dropped, logged and counted: the start goes on without them.
"""

from __future__ import annotations

import logging
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from .format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_HASH_BYTES,
    MAX_PAYLOAD_BYTES,
    RECORD_MAGIC,
    FormatError,
    hasher,
)
from .io import AlignedBuffer, FileIO
from .ring import Index, Record, Ring, State

logger = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20
_MAGIC = int.from_bytes(RECORD_MAGIC, "little")
# format._HEADER ("<8sHBB16s64s16sQQQ") and its CRC-32, as numpy fields
_HEADER = np.dtype(
    {
        "names": ["version", "cid", "hlen", "ns", "hash", "store"],
        "formats": ["<u2", "u1", "u1", "V16", f"V{MAX_HASH_BYTES}", "V16"],
        "offsets": [8, 10, 11, 12, 28, 92],
        "itemsize": 136,
    }
)
_NUMS = np.dtype({"names": ["seq", "plen", "csum"], "formats": ["<u8"] * 3})
_NUMS_AT, _CRC_AT, _BODY = 108, 132, 132
# one row per record header found intact
_FOUND = np.dtype(
    [
        ("offset", "<u8"),
        ("length", "<u8"),
        ("seq", "<u8"),
        ("plen", "<u8"),
        ("csum", "<u8"),
        ("cid", "u1"),
        ("hlen", "u1"),
        ("checked", "?"),  # payload checked (False: crosses its chunk's end)
        ("ns", "V16"),
        ("hash", f"V{MAX_HASH_BYTES}"),
    ]
)


@dataclass(frozen=True, slots=True)
class Scanned:
    live: int
    dropped: int  # headers found whose record is torn, damaged or overwritten
    next_seq: int
    bytes_read: int
    checksum_ids: frozenset[int]  # named by the intact headers of this store
    unreadable_bytes: int  # chunks whose read failed (bad sectors): skipped


def _payload_ok(cid: int, payload: memoryview, checksum: int) -> bool:
    try:
        return hasher(cid)(payload) == checksum
    except (FormatError, ImportError):
        return False


class _Scanner:
    def __init__(self, io: FileIO, store_id: bytes, threads: int) -> None:
        self.io = io
        self.store_id = np.frombuffer(store_id, np.uint8)
        self.threads = threads
        self._local = threading.local()
        self.dropped = 0
        self.unreadable_bytes = 0
        self.checksum_ids: set[int] = set()
        self._lock = threading.Lock()

    def _buffer(self, nbytes: int) -> AlignedBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = AlignedBuffer(nbytes)
            with self._lock:
                self._buffers.append(buf)
        buf.ensure(nbytes)
        return buf

    def chunk(self, ring: Ring, start: int) -> np.ndarray:
        """The intact record headers of [start, start + CHUNK_BYTES) of a ring."""
        nbytes = min(CHUNK_BYTES, ring.end - start)
        buf = self._buffer(nbytes)
        try:
            self.io.pread(ring.file, buf.address, nbytes, start)
        except OSError as exc:  # a bad sector costs its chunk, not the start
            logger.warning(
                "ssd scan: %d B of file %d at %d unreadable (%s); the records "
                "there are dropped",
                nbytes,
                ring.file,
                start,
                exc,
            )
            with self._lock:
                self.unreadable_bytes += nbytes
            return np.empty(0, _FOUND)
        pages = buf.view(0, nbytes).cast("B")
        table = np.frombuffer(pages, np.uint8).reshape(-1, ALIGN)
        # header page candidates: pages that start with the record magic
        first = np.ascontiguousarray(table[:, :8]).view("<u8")[:, 0]
        at = np.flatnonzero(first == _MAGIC)
        if not at.size:
            return np.empty(0, _FOUND)
        raw = np.ascontiguousarray(table[at, : _HEADER.itemsize])
        head = raw.view(_HEADER)[:, 0]
        nums = np.ascontiguousarray(raw[:, _NUMS_AT:_CRC_AT]).view(_NUMS)[:, 0]
        crc = np.ascontiguousarray(raw[:, _CRC_AT : _CRC_AT + 4]).view("<u4")[:, 0]
        # CRC-32 has no numpy form: one C call per candidate (no per-block logic)
        body_crc = np.fromiter(map(zlib.crc32, raw[:, :_BODY]), np.uint32, at.size)
        plen = nums["plen"]
        length = HEADER_BYTES + (plen + (ALIGN - 1)) // ALIGN * ALIGN
        offset = start + at.astype(np.uint64) * ALIGN
        ours = (raw[:, 92:108] == self.store_id).all(axis=1)  # else: older files
        ok = (
            ours
            & (body_crc == crc)
            & (head["version"] == FORMAT_VERSION)
            & (head["hlen"] > 0)
            & (head["hlen"] <= MAX_HASH_BYTES)
            & (plen <= MAX_PAYLOAD_BYTES)  # what the store writes; no overflow below
            & (offset + length <= ring.end)
        )
        found = np.empty(int(ok.sum()), _FOUND)
        for name, col in (("seq", nums["seq"]), ("plen", plen), ("csum", nums["csum"])):
            found[name] = col[ok]
        for name in ("cid", "hlen", "ns", "hash"):
            found[name] = head[name][ok]
        found["offset"], found["length"] = offset[ok], length[ok]
        found["checked"] = offset[ok] + length[ok] <= start + nbytes
        keep = np.ones(found.size, bool)
        for i in np.flatnonzero(found["checked"]).tolist():  # hash each payload
            lo = int(found["offset"][i]) - start + HEADER_BYTES
            row = found[i]
            payload = pages[lo : lo + int(row["plen"])]
            keep[i] = _payload_ok(int(row["cid"]), payload, int(row["csum"]))
        with self._lock:
            self.dropped += int(ours.sum()) - int(keep.sum())
            self.checksum_ids.update(np.unique(found["cid"]).tolist())
        return found[keep]

    def recheck(self, ring: Ring, row: np.void) -> bool:
        """Read a record that crossed a chunk boundary whole and check its
        payload; False when it does not match or cannot be read."""
        length = int(row["length"])
        buf = self._buffer(length)
        try:
            self.io.pread(ring.file, buf.address, length, int(row["offset"]))
        except OSError as exc:
            logger.warning(
                "ssd scan: record at %d of file %d unreadable (%s); dropped",
                int(row["offset"]),
                ring.file,
                exc,
            )
            return False
        payload = buf.view(HEADER_BYTES, HEADER_BYTES + int(row["plen"]))
        return _payload_ok(int(row["cid"]), payload, int(row["csum"]))

    def run(self, rings: list[Ring], progress: bool) -> list[np.ndarray]:
        self._buffers: list[AlignedBuffer] = []
        jobs = [
            (ring, start)
            for ring in rings
            for start in range(ring.start, ring.end, CHUNK_BYTES)
        ]
        total = sum(r.end - r.start for r in rings)
        bar = tqdm(
            total=total,
            desc="scanning ssd cache",
            unit="B",
            unit_scale=True,
            disable=not progress,
        )
        per_ring: list[list[np.ndarray]] = [[] for _ in rings]
        try:
            with ThreadPoolExecutor(self.threads, "ssd-scan") as pool:
                for (ring, start), found in zip(
                    jobs, pool.map(lambda job: self.chunk(*job), jobs), strict=True
                ):
                    per_ring[ring.file].append(found)
                    bar.update(min(CHUNK_BYTES, ring.end - start))
                kept = [_newest(np.concatenate(f)) for f in per_ring]
                self.dropped += sum(int(k[1]) for k in kept)
                out = []
                for ring, (found, _) in zip(rings, kept, strict=True):
                    out.append(self._recheck_crossing(pool, ring, found))
        finally:
            bar.close()
            for buf in self._buffers:
                buf.close()
        return out

    def _recheck_crossing(
        self, pool: ThreadPoolExecutor, ring: Ring, found: np.ndarray
    ) -> np.ndarray:
        todo = np.flatnonzero(~found["checked"])

        def check(i: int) -> bool:
            return self.recheck(ring, found[i])

        good = np.ones(found.size, bool)
        good[todo] = list(pool.map(check, todo.tolist()))
        self.dropped += int((~good).sum())
        return found[good]


def _newest(found: np.ndarray) -> tuple[np.ndarray, int]:
    """Drop every record that a newer one overlaps (it overwrote part of it);
    returns the survivors by offset and how many were dropped."""
    found = found[np.argsort(found["offset"], kind="stable")]
    dropped = 0
    while found.size > 1:
        end = found["offset"][:-1] + found["length"][:-1]
        clash = np.flatnonzero(end > found["offset"][1:])
        if not clash.size:
            break
        older = np.where(
            found["seq"][clash] < found["seq"][clash + 1], clash, clash + 1
        )
        keep = np.ones(found.size, bool)
        keep[older] = False
        dropped += found.size - int(keep.sum())
        found = found[keep]
    return found, dropped


def _place(ring: Ring, found: np.ndarray, index: Index) -> int:
    """Put the survivors into the ring (oldest first from the head) and the index
    (newest copy of a key wins); returns the highest sequence number."""
    if not found.size:
        return 0
    newest = int(np.argmax(found["seq"]))
    ring.head = int(found["offset"][newest] + found["length"][newest])
    order = np.argsort(found["offset"] < ring.head, kind="stable")  # wrap at head
    records = []
    for row in found[order].tolist():
        off, length, seq, plen, csum, cid, hlen, _, ns, block_hash = row
        rec = Record(ring.file, off, length, seq, ns, block_hash[:hlen])
        rec.payload_len, rec.checksum, rec.checksum_id = plen, csum, cid
        rec.state = State.LIVE
        records.append(rec)
    ring.records.extend(records)
    for rec in sorted(records, key=lambda r: r.seq):
        index.put(rec)
    return int(found["seq"][newest])


def scan(
    io: FileIO,
    rings: list[Ring],
    index: Index,
    store_id: bytes,
    threads: int,
    progress: bool,
) -> Scanned:
    """Rebuild rings (empty on entry) and index from the record headers on disk."""
    scanner = _Scanner(io, store_id, max(1, threads))
    survivors = scanner.run(rings, progress)
    top = max((_place(r, f, index) for r, f in zip(rings, survivors, strict=True)))
    total = sum(r.end - r.start for r in rings)
    ids = frozenset(scanner.checksum_ids)
    return Scanned(
        index.count, scanner.dropped, top + 1, total, ids, scanner.unreadable_bytes
    )
