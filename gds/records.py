"""Record bytes of one request: the parts of a run to write (header pages built,
unaligned payloads staged) and the parts of a piece to read back, verified.

No bookkeeping and no lock here: the store has made the records busy (being
written, or pinned for reading) before it calls in, so their space is safe.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pegaflow.common import checksum_rows
from pegaflow.common.runs import merge_adjacent, merge_parts

from .format import (
    ALIGN,
    CHECKSUM_IDS,
    HEADER_BYTES,
    HEADER_DTYPE,
    FormatError,
    RecordHeader,
    hash_parts,
    header_rows,
)
from .io import AlignedBuffer, FileIO, Part, copy_within, host_view, host_views
from .ring import Record

logger = logging.getLogger(__name__)

_ZERO_PAGE = bytes(HEADER_BYTES)
_XXH3 = CHECKSUM_IDS["xxh3"]


@dataclass(frozen=True, slots=True)
class SlotTable:
    """Payloads of a run of one geometry: record i's payload is the `each`
    bytes at every address of slots[i] ([records, shards] uint64), back to
    back (its TP-shard slots). Sliced like the list of parts it stands for."""

    slots: np.ndarray
    each: int

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, rows: slice) -> SlotTable:
        return SlotTable(self.slots[rows], self.each)

    def parts(self) -> list[list[Part]]:
        return [[(a, self.each) for a in row] for row in self.slots.tolist()]


Payloads = SlotTable | Sequence[Sequence[Part]]


def gather(
    run: list[Record], payloads: Payloads, buf: AlignedBuffer, store_id: bytes
) -> tuple[list[Part], bool]:
    """gather_parts, with payloads as a SlotTable (the tier's usual form) or
    as (address, bytes) parts per record. When every slot is 4 KiB-aligned
    (the pool's are) the run is built with array operations and a C call or
    two per block (gather_in_place); else record by record."""
    if not isinstance(payloads, SlotTable):
        return gather_parts(run, payloads, buf, store_id)
    slots, each = payloads.slots, payloads.each
    want = slots.shape[1] * each
    if [r.payload_len for r in run].count(want) != len(run):
        raise ValueError(f"payload of {want} B per record, given other lengths")
    if each % ALIGN == 0 and not (slots % ALIGN).any():
        return gather_in_place(run, slots, each, buf, store_id), True
    if len({r.length for r in run}) == 1:
        return gather_staged(run, slots, each, buf, store_id), False
    return gather_parts(run, payloads.parts(), buf, store_id)


def gather_in_place(
    run: list[Record],
    slots: np.ndarray,
    each: int,
    buf: AlignedBuffer,
    store_id: bytes,
) -> list[Part]:
    """Every payload written from its slots: checksums, then the run's header
    pages (one HEADER_DTYPE row each) in buf, and the iovec (header page, the
    record's slots; adjacent parts merged). Bytes as gather_parts writes."""
    n, shards = slots.shape
    buf.ensure(n * HEADER_BYTES)
    _set_row_checksums(run, slots, each)
    pages = np.frombuffer(buf.view(0, n * HEADER_BYTES), np.uint8).reshape(n, -1)
    _set_header_pages(pages, run, store_id)
    heads = buf.address + HEADER_BYTES * np.arange(n, dtype=np.uint64)
    starts = np.concatenate([heads[:, None], slots.astype(np.uint64)], axis=1)
    sizes = np.full(starts.shape, each, np.uint64)
    sizes[:, 0] = HEADER_BYTES
    (addr,), nbytes = merge_adjacent([starts.ravel()], sizes.ravel())
    return list(zip(addr.tolist(), nbytes.tolist(), strict=True))


def gather_staged(
    run: list[Record],
    slots: np.ndarray,
    each: int,
    buf: AlignedBuffer,
    store_id: bytes,
) -> list[Part]:
    """Every payload copied behind its header page in buf (slots off a 4 KiB
    boundary, a host engine's, cannot be written with O_DIRECT): records of
    one length laid out as rows of buf, the copies as one call per run
    (copy_within), padding and header pages set by array operations; the run
    is one part. Bytes as gather_parts writes."""
    n, shards = slots.shape
    length, payload = run[0].length, shards * each
    buf.ensure(n * length)
    rows_of = np.frombuffer(buf.view(0, n * length), np.uint8).reshape(n, length)
    firsts = buf.address + HEADER_BYTES + length * np.arange(n, dtype=np.uint64)
    dst = firsts[:, None] + each * np.arange(shards, dtype=np.uint64)
    copy_within(dst.ravel(), slots.astype(np.uint64).ravel(), each)
    rows_of[:, HEADER_BYTES + payload :] = 0
    _set_row_checksums(run, firsts[:, None], payload)
    _set_header_pages(rows_of[:, :HEADER_BYTES], run, store_id)
    return [(buf.address, n * length)]


def _set_row_checksums(run: list[Record], slots: np.ndarray, each: int) -> None:
    """Each record's checksum over its row of `slots` (`each` bytes at every
    address, back to back)."""
    algo = run[0].checksum_id  # one per store: every record of a run has it
    for rec, checksum in zip(run, _row_checksums(algo, slots, each), strict=True):
        rec.checksum = checksum


def _row_checksums(algo: int, slots: np.ndarray, each: int) -> list[int]:
    """The checksum `algo` of each row of `slots` ([rows, parts] addresses,
    `each` bytes at every one, back to back). xxh3, the default, for all
    rows in one call without the GIL (pegaflow.common.checksum_rows); the other
    algorithms (records of older stores) a call per row."""
    if algo == _XXH3:
        return checksum_rows.rows(slots, each).tolist()
    views = host_views([(a, each) for a in slots.ravel().tolist()])
    k = slots.shape[1]
    return [hash_parts(algo, views[i : i + k]) for i in range(0, len(views), k)]


def _set_header_pages(pages: np.ndarray, run: list[Record], store_id: bytes) -> None:
    """[records, HEADER_BYTES] uint8 rows: each record's header, zeros after it
    (no stale bytes from the last run)."""
    pages[:, HEADER_DTYPE.itemsize :] = 0
    pages[:, : HEADER_DTYPE.itemsize] = (
        header_rows(run, store_id).view(np.uint8).reshape(len(run), -1)
    )


def gather_parts(
    run: list[Record],
    payloads: Sequence[Sequence[Part]],
    buf: AlignedBuffer,
    store_id: bytes,
) -> tuple[list[Part], bool]:
    """Checksum each payload, build its header page in buf, stage the payloads
    that cannot be written in place. Returns the run's parts in file order
    (contiguous ones merged) and whether any payload is written in place."""
    direct = [
        all(a % ALIGN == 0 and n % ALIGN == 0 for a, n in parts) for parts in payloads
    ]
    buf.ensure(
        sum(
            HEADER_BYTES if d else rec.length
            for rec, d in zip(run, direct, strict=True)
        )
    )
    iov: list[Part] = []
    at = 0
    for rec, parts, d in zip(run, payloads, direct, strict=True):
        if sum(n for _, n in parts) != rec.payload_len:
            raise ValueError(f"payload of {rec.payload_len} B given in other parts")
        head = buf.address + at
        if d:
            views = [host_view(a, n) for a, n in parts]
            iov.append((head, HEADER_BYTES))
            iov.extend(parts)
            at += HEADER_BYTES
        else:
            dst = head + HEADER_BYTES
            for a, n in parts:
                ctypes.memmove(dst, a, n)
                dst += n
            ctypes.memset(dst, 0, rec.length - HEADER_BYTES - rec.payload_len)
            start = at + HEADER_BYTES
            views = [buf.view(start, start + rec.payload_len)]
            iov.append((head, rec.length))
            at += rec.length
        rec.checksum = hash_parts(rec.checksum_id, views)
        page = buf.view(head - buf.address, head - buf.address + HEADER_BYTES)
        page[:] = _ZERO_PAGE  # no stale bytes from the last run
        RecordHeader(
            rec.ns_digest,
            rec.block_hash,
            store_id,
            rec.seq,
            rec.payload_len,
            rec.checksum,
            rec.checksum_id,
        ).pack_into(page)
    return merge_parts(iov), any(direct)


def read_pieces(
    io: FileIO,
    store_id: bytes,
    run: list[Record],
    dests: Sequence[Sequence[int]],
    each: int,
    buf: AlignedBuffer,
    ok: list[bool],
    failures: list[tuple[Record, str]],
) -> None:
    """read_piece over the records of `run` that fit the caller's geometry, in
    pieces of back-to-back ones (one request per piece); ok[i] set per record.
    A record of other geometry is left False (and not a failure)."""
    piece: list[int] = []
    for i, rec in enumerate([*run, None]):
        if piece and (
            rec is None
            or rec.file != run[piece[-1]].file
            or rec.offset != run[piece[-1]].offset + run[piece[-1]].length
            or rec.payload_len != len(dests[i]) * each
        ):
            got = read_piece(
                io,
                store_id,
                [run[j] for j in piece],
                [dests[j] for j in piece],
                each,
                buf,
                failures,
            )
            for j, good in zip(piece, got, strict=True):
                ok[j] = good
            piece = []
        if rec is not None and rec.payload_len == len(dests[i]) * each:
            piece.append(i)


def read_piece(
    io: FileIO,
    store_id: bytes,
    recs: list[Record],
    dests: Sequence[Sequence[int]],
    each: int,
    buf: AlignedBuffer,
    failures: list[tuple[Record, str]],
) -> list[bool]:
    """Read records that lie back to back in one file in one request and
    verify each; ok per record. dests: [records, shards] slot addresses,
    `each` bytes apiece. A record whose slots are all 4 KiB-aligned is read
    straight into them; any other into buf, verified there and copied out.
    Each failed record is added to `failures` with the counter it bumps (the
    caller drops it)."""
    table = np.asarray(dests, np.uint64).reshape(len(recs), -1)
    in_place = (each % ALIGN == 0) & (table % np.uint64(ALIGN) == 0).all(axis=1)
    lengths = np.array([rec.length for rec in recs], np.int64)
    # Each record's header page (or whole record) in buf, back to back.
    taken = np.where(in_place, HEADER_BYTES, lengths)
    where = np.r_[0, np.cumsum(taken)[:-1]]
    buf.ensure(int(taken.sum()))
    iov: list[Part] = []
    for d, p, at, n in zip(
        table.tolist(), in_place.tolist(), where.tolist(), taken.tolist(), strict=True
    ):
        iov.append((buf.address + at, n))
        if p:
            iov.extend((a, each) for a in d)
    try:
        io.preadv(recs[0].file, merge_parts(iov), recs[0].offset)
    except OSError as exc:
        logger.warning(
            "ssd read of %d B failed: %s",
            recs[-1].offset + recs[-1].length - recs[0].offset,
            exc,
        )
        failures.extend((rec, "read_errors") for rec in recs)
        return [False] * len(recs)
    failed = [
        header_failure(rec, store_id, buf.view(at, at + HEADER_BYTES))
        for rec, at in zip(recs, where.tolist(), strict=True)
    ]
    # Where each payload lies now: in its slots, or in buf after its header.
    payloads = table.copy()
    staged = ~in_place
    payloads[staged] = (
        np.uint64(buf.address + HEADER_BYTES)
        + where[staged].astype(np.uint64)[:, None]
        + np.uint64(each) * np.arange(table.shape[1], dtype=np.uint64)
    )
    _check_payloads(recs, payloads, each, failed)
    out = np.array([not f for f in failed], bool)
    if (staged & out).any():
        copy_within(table[staged & out].ravel(), payloads[staged & out].ravel(), each)
    failures.extend((rec, f) for rec, f in zip(recs, failed, strict=True) if f)
    return out.tolist()


def _check_payloads(
    recs: list[Record], payloads: np.ndarray, each: int, failed: list[str]
) -> None:
    """Mark failed[i] "checksum_failures" where record i's payload (`each`
    bytes at every address of payloads[i], back to back) does not hash to its
    checksum; records already failed are skipped. One call per checksum
    algorithm among the records (xxh3 alone, but for older stores')."""
    algos = np.array([rec.checksum_id for rec in recs])
    todo = np.array([not f for f in failed], bool)
    for algo in np.unique(algos[todo]).tolist():
        rows = np.flatnonzero(todo & (algos == algo))
        try:
            sums = _row_checksums(algo, payloads[rows], each)
        except (FormatError, ImportError):  # an algorithm this server cannot run
            sums = [None] * len(rows)
        for i, got in zip(rows.tolist(), sums, strict=True):
            if got != recs[i].checksum:
                failed[i] = "checksum_failures"


def header_failure(rec: Record, store_id: bytes, page: memoryview) -> str:
    """The counter to bump, or "" when the header page is intact and names the
    record the index holds (with its checksum: the payload is then checked
    against rec.checksum)."""
    try:
        head = RecordHeader.unpack(page)
    except FormatError:
        return "header_mismatches"
    expect = (store_id, rec.seq, rec.ns_digest, rec.block_hash)
    got = (head.store_id, head.seq, head.ns_digest, head.block_hash)
    if got != expect or head.payload_len != rec.payload_len:
        return "header_mismatches"
    if head.checksum != rec.checksum or head.checksum_id != rec.checksum_id:
        return "header_mismatches"
    return ""


def verify(
    rec: Record, store_id: bytes, page: memoryview, payload: list[memoryview]
) -> str:
    """The counter to bump, or "" when the record is intact and the one
    indexed: its header page, then the payload's parts (back to back)."""
    failure = header_failure(rec, store_id, page)
    if failure:
        return failure
    try:
        if hash_parts(rec.checksum_id, payload) != rec.checksum:
            return "checksum_failures"
    except (FormatError, ImportError):
        return "checksum_failures"
    return ""
