"""The plan of an SSD → GPU direct load: SSD records → engine GPU blocks as one
batch of (file, file offset, device address, bytes) reads. Pure numpy, no I/O.

A record's payload is one L1 slot's bytes (pegaflow.common.geometry: the (layer,
segment) rows back to back), so row r of the record for engine block b lies at

    file offset  rec.offset + HEADER_BYTES + slot_offset[r]
    device       engine_offset[r] + b * block_stride[r]

and moves seg_bytes[r] bytes. Reads that continue each other both on disk and
on the device are merged (pegaflow.common.runs.merge_adjacent): a block-major engine
layout reads a whole record in one request, a layer-major one (vLLM 0.33's
LBNHC) one page per request. Every range is checked against its record's
payload and the registered device regions before anything is read: a plan
that would write outside them is our bug (InternalError), never a write.

Only single-shard records plan (TP 1, or MLA's replicated shard): a record of
several TP shards is checksummed over all of them, which one rank's direct read
cannot verify; those, and records of another geometry, take the L1 route.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import KVGeometry
from pegaflow.common.runs import merge_adjacent

from .format import HEADER_BYTES

_FILE_STEP = 1 << 48  # above any load's bytes (max_blocks_per_request * slot)


@dataclass(frozen=True, slots=True)
class RecordSpans:
    """Where the records of one load lie: arrays of one entry per record."""

    file: np.ndarray  # data file index
    offset: np.ndarray  # the record's header page, bytes into the file
    length: np.ndarray  # the record's bytes on disk (header + padded payload)
    payload: np.ndarray  # its payload bytes


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """One load's reads and how to check them.

    planned[i]: record i is in the plan (False: another geometry; L1 route).
    Reads: file[j], file_offset[j] → device[j], nbytes[j], ordered by file and
    offset. Checks: back[k], back_bytes[k] are device ranges in payload order
    of the planned records, back to back: fetched into host memory they are
    each planned record's payload, slot_bytes apiece, for its checksum."""

    planned: np.ndarray
    file: np.ndarray
    file_offset: np.ndarray
    device: np.ndarray
    nbytes: np.ndarray
    back: np.ndarray
    back_bytes: np.ndarray
    slot_bytes: int

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return len(self.nbytes)


def plan_reads(
    spans: RecordSpans,
    block_ids: np.ndarray,
    geometry: KVGeometry,
    regions: list[tuple[int, int]],
) -> ReadPlan:
    """The reads of records `spans` into engine blocks `block_ids` (one per
    record), for a worker of `geometry` whose GPU memory is `regions`
    ((device base, bytes) each, as opened in the server)."""
    ids = np.asarray(block_ids, np.int64)
    n = len(ids)
    if len(spans.offset) != n:
        raise InternalError(f"direct load: {len(spans.offset)} records, {n} blocks")
    slot = geometry.slot_bytes
    planned = np.asarray(spans.payload, np.uint64) == np.uint64(slot)
    rows = len(geometry.seg_bytes)
    ids_p = ids[planned]
    _check_ids(ids_p, geometry.num_blocks)
    # [records, rows]: disk side, device side, bytes
    base = np.asarray(spans.offset, np.uint64)[planned] + np.uint64(HEADER_BYTES)
    disk = base[:, None] + geometry.slot_offset[None, :]
    dev = (
        geometry.engine_offset[None, :]
        + ids_p.astype(np.uint64)[:, None] * geometry.block_stride[None, :]
    )
    size = np.broadcast_to(geometry.seg_bytes[None, :], dev.shape).ravel()
    if int(size.sum()) >= _FILE_STEP:
        raise InternalError("direct load: more than 2**48 bytes in one plan")
    files = np.repeat(np.asarray(spans.file, np.int64)[planned], rows)
    _check_disk(spans, planned, disk, size.reshape(disk.shape), slot)
    _check_device(dev.ravel(), size, regions, np.repeat(ids_p, rows))
    # Checks first, in payload order (host side: record k at k * slot_bytes).
    host = np.arange(len(ids_p), dtype=np.uint64)[:, None] * np.uint64(slot)
    host = (host + geometry.slot_offset[None, :]).ravel()
    (back, _), back_bytes = merge_adjacent([dev.ravel(), host], size)
    # Reads by file and offset, merged within each file.
    order = np.lexsort((disk.ravel(), files))
    f, d, v, s = files[order], disk.ravel()[order], dev.ravel()[order], size[order]
    # A read continues the one before only in the same file: a side of its
    # own, file * 2**48 + the bytes planned before it, continues exactly then.
    before = np.cumsum(s, dtype=np.uint64) - s
    fside = f.astype(np.uint64) * np.uint64(_FILE_STEP) + before
    (f_m, d_m, v_m), s_m = merge_adjacent([fside, d, v], s)
    file_m = (f_m // np.uint64(_FILE_STEP)).astype(np.int64)
    return ReadPlan(
        planned, file_m, d_m, v_m, np.asarray(s_m, np.uint64), back, back_bytes, slot
    )


def _check_ids(ids: np.ndarray, num_blocks: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise InternalError(f"direct load: block id {bad} outside [0, {num_blocks})")
    if len(np.unique(ids)) != len(ids):
        raise InternalError("direct load: two records into one engine block")


def _check_disk(
    spans: RecordSpans,
    planned: np.ndarray,
    disk: np.ndarray,
    size: np.ndarray,
    slot: int,
) -> None:
    """Every read lies inside its record's payload, and the payload inside
    the record's length on disk."""
    offset = np.asarray(spans.offset, np.uint64)[planned]
    length = np.asarray(spans.length, np.uint64)[planned]
    if (length < np.uint64(HEADER_BYTES + slot)).any():
        raise InternalError("direct load: a record shorter than its payload")
    lo = offset + np.uint64(HEADER_BYTES)
    hi = (lo + np.uint64(slot))[:, None]
    if disk.size and ((disk < lo[:, None]).any() or (disk + size > hi).any()):
        raise InternalError("direct load: a read outside its record's payload")


def _check_device(
    dev: np.ndarray, size: np.ndarray, regions: list[tuple[int, int]], ids: np.ndarray
) -> None:
    """Every destination lies inside one registered region."""
    if not dev.size:
        return
    if not regions:
        raise InternalError("direct load: the worker registered no GPU regions")
    table = np.array(sorted(regions), np.uint64).reshape(-1, 2)
    i = np.searchsorted(table[:, 0], dev, side="right").astype(np.int64) - 1
    inside = i >= 0
    j = np.maximum(i, 0)
    end = table[j, 0] + table[j, 1]
    inside &= dev + size <= end
    if not inside.all():
        k = int(np.flatnonzero(~inside)[0])
        raise InternalError(
            f"direct load: block {int(ids[k])}'s page at {int(dev[k]):#x} "
            f"+ {int(size[k])} B leaves the worker's registered GPU memory"
        )
