"""KV memory geometry: where each (layer, block) page of an engine lives, and where
it lives in an L1 slot. Everything here is vectorised numpy; it produces the copy
descriptor tables that the host copy engine and the CUDA kernels both consume.

A page of (layer l, block b) may consist of several segments (K/V-first layouts put
K and V far apart). Segment s of that page starts at

    region_base + layer.offset + b * layer.block_stride + layer.segments[s].offset

In an L1 slot (one TP shard of one block, all layers) the segments are packed
back to back in (layer, segment) order, so two engines with different physical
layouts but equal segment sizes produce the same slot bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequest

MAX_LAYERS = 4096
MAX_SEGMENTS_PER_LAYER = 8


@dataclass(frozen=True, slots=True)
class Segment:
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """One layer's pages inside a registered memory region."""

    region_index: int
    offset: int
    num_blocks: int
    block_stride: int
    segments: tuple[Segment, ...]

    @property
    def page_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def span_end(self) -> int:
        """One past the last byte any block of this layer touches."""
        last = max(s.offset + s.size for s in self.segments)
        return self.offset + (self.num_blocks - 1) * self.block_stride + last


@dataclass(frozen=True, slots=True)
class Transfers:
    """A copy descriptor table: copy nbytes[i] bytes from src[i] to dst[i]."""

    src: np.ndarray  # uint64 addresses
    dst: np.ndarray  # uint64 addresses
    nbytes: np.ndarray  # uint64
    _total: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        """Summed once: a copy asks 3-8 times (dispatch, path choice, rates,
        accounting), ~2 us a sum on a 1-block table. Nothing writes a table's
        arrays after it is built."""
        if self._total is None:
            object.__setattr__(self, "_total", int(self.nbytes.sum()))
        return self._total  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.nbytes)


class KVGeometry:
    """Precomputed per-(layer, segment) tables for one registered worker."""

    def __init__(self, layers: tuple[LayerLayout, ...], region_bases: list[int]):
        seg_counts = [len(layer.segments) for layer in layers]
        rows = sum(seg_counts)
        # One row per (layer, segment), in slot order.
        self.engine_offset = np.empty(rows, np.uint64)
        self.block_stride = np.empty(rows, np.uint64)
        self.seg_bytes = np.empty(rows, np.uint64)
        i = 0
        for layer in layers:  # per layer, at registration only, not on a data path
            base = region_bases[layer.region_index] + layer.offset
            for seg in layer.segments:
                self.engine_offset[i] = base + seg.offset
                self.block_stride[i] = layer.block_stride
                self.seg_bytes[i] = seg.size
                i += 1
        self.slot_offset = np.concatenate(([0], np.cumsum(self.seg_bytes)[:-1])).astype(
            np.uint64
        )
        self.slot_bytes = int(self.seg_bytes.sum())
        self.num_blocks = layers[0].num_blocks
        self.num_layers = len(layers)
        self.layer_rows = np.repeat(np.arange(len(layers)), seg_counts)
        self._all_rows = np.arange(rows)
        self._layer_ids = np.arange(len(layers))

    def engine_to_slots(
        self, block_ids: np.ndarray, slot_addrs: np.ndarray, layer_ids: np.ndarray
    ) -> Transfers:
        """Descriptors copying the given layers of engine blocks into slots."""
        return self._transfers(block_ids, slot_addrs, self._rows(layer_ids))

    def _rows(self, layer_ids: np.ndarray) -> np.ndarray:
        """The (layer, segment) rows of `layer_ids`, in slot order. A mask
        over the layers, not np.isin: ~10 vs ~50 us a request (dev VM)."""
        ids = np.asarray(layer_ids)
        if not ids.size:
            return np.zeros(0, np.intp)
        if len(ids) == self.num_layers and (ids == self._layer_ids).all():
            return self._all_rows  # every layer in order, the usual save
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.num_layers:
            return np.flatnonzero(np.isin(self.layer_rows, ids))  # ids outside
        wanted = np.zeros(self.num_layers, bool)
        wanted[ids] = True
        return np.flatnonzero(wanted[self.layer_rows])

    def _transfers(
        self, block_ids: np.ndarray, slot_addrs: np.ndarray, rows: np.ndarray
    ) -> Transfers:
        if rows is self._all_rows:  # every row: no gather of the tables
            offset, stride = self.engine_offset, self.block_stride
            slot_offset, seg = self.slot_offset, self.seg_bytes
            if len(block_ids) == 1:  # a decode step's block: 1-D, no broadcast
                eng = offset + stride * np.uint64(block_ids[0])
                slot = slot_offset + np.uint64(slot_addrs[0])
                return Transfers(eng, slot, seg.copy())
        else:
            offset, stride = self.engine_offset[rows], self.block_stride[rows]
            slot_offset, seg = self.slot_offset[rows], self.seg_bytes[rows]
        eng = offset[None, :] + block_ids.astype(np.uint64)[:, None] * stride[None, :]
        slot = slot_addrs.astype(np.uint64)[:, None] + slot_offset[None, :]
        size = np.empty(eng.shape, np.uint64)
        size[...] = seg
        return Transfers(eng.ravel(), slot.ravel(), size.ravel())

    def slots_to_engine(
        self, slot_addrs: np.ndarray, block_ids: np.ndarray
    ) -> Transfers:
        """Descriptors copying whole slots back into engine blocks."""
        t = self._transfers(block_ids, slot_addrs, self._all_rows)
        return Transfers(t.dst, t.src, t.nbytes)

    @property
    def page_skew(self) -> int:
        """Engine pages' common offset modulo 4 KiB, or 0 when they have none.

        Slots placed at the same offset copy without 4K aliasing.
        """
        residues = self.engine_offset % np.uint64(4096)
        if (residues != residues[0]).any() or (self.seg_bytes % np.uint64(4096)).any():
            return 0
        if (self.block_stride % np.uint64(4096)).any():
            return 0
        return int(residues[0])

    def signature(self) -> tuple[int, ...]:
        """What must agree between workers sharing a namespace: segment sizes."""
        return (self.num_layers, *self.seg_bytes.tolist())


def check_distinct(block_ids: np.ndarray, field: str) -> None:
    """A load writes each engine block once: two items (or one) naming the same
    destination would race each other's bytes."""
    if len(block_ids) < 2:
        return
    ordered = np.sort(block_ids, kind="stable")
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(same):
        raise InvalidRequest(
            f"{field}: engine block {int(ordered[same[0]])} is loaded into more "
            "than once in this request"
        )


# Up to this many ids are bounds-checked as Python ints: two numpy reductions
# cost ~5 us, more than the rest of a 1-block request's id checks.
SMALL_IDS = 16


def check_block_ids(block_ids: np.ndarray, num_blocks: int, field: str) -> None:
    """Every id must address a block the worker registered."""
    if not block_ids.size:
        return
    if block_ids.size <= SMALL_IDS:
        ids = block_ids.ravel().tolist()
        lo, hi = min(ids), max(ids)
    else:
        lo, hi = block_ids.min(), block_ids.max()
    if lo < 0 or hi >= num_blocks:
        bad = block_ids[(block_ids < 0) | (block_ids >= num_blocks)][0]
        raise InvalidRequest(f"{field}: block id {int(bad)} outside [0, {num_blocks})")


# Pairs of page series compared at registration: 1,024 series (64 layers x
# 16 segments, past any real layout) are half a million pairs, a few ms.
MAX_OVERLAP_SERIES = 1024


def first_overlap(layers: tuple[LayerLayout, ...]) -> str | None:
    """Where two pages of a layout share memory, or None.

    Each (layer, segment) is a series of pages, one per block, `block_stride`
    apart. Two series of one region and one stride S overlap exactly when
    some block distance m (|m| < blocks) gives d - w_i < m*S < d + w_j (d the
    offset between their first pages, w their sizes): one vectorised test per
    pair, however many blocks. Series of different strides, or more than
    MAX_OVERLAP_SERIES of them, are not compared (no real layout has them)."""
    rows = [
        (lay.region_index, lay.block_stride, lay.offset + seg.offset, seg.size, i, s)
        for i, lay in enumerate(layers)
        for s, seg in enumerate(lay.segments)
    ]
    if not rows or len(rows) > MAX_OVERLAP_SERIES:
        return None
    blocks = layers[0].num_blocks
    table = np.array(rows, np.int64)
    region, stride, start, size = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    i, j = np.triu_indices(len(rows), 1)
    same = (region[i] == region[j]) & ((stride[i] == stride[j]) | (blocks == 1))
    i, j = i[same], j[same]
    d, wi, wj, s = start[j] - start[i], size[i], size[j], stride[i]
    if blocks == 1:
        m = np.zeros(len(d), np.int64)
    else:  # the least m with m*S > d - wi, no less than -(blocks - 1)
        m = np.maximum(np.floor_divide(d - wi, s) + 1, -(blocks - 1))
    clash = (m <= blocks - 1) & (d - wi < m * s) & (m * s < d + wj)
    if clash.any():
        k = int(np.flatnonzero(clash)[0])
        a, b, gap = rows[int(i[k])], rows[int(j[k])], int(m[k])
        ka, kb = (gap, 0) if gap >= 0 else (0, -gap)
        return (
            f"layers[{b[4]}].segments[{b[5]}]: block {kb} shares memory with "
            f"block {ka} of layers[{a[4]}].segments[{a[5]}]"
        )
    inner = (stride < size) & (blocks > 1)  # a series' own pages overlap
    if inner.any():
        a = rows[int(np.flatnonzero(inner)[0])]
        return (
            f"layers[{a[4]}].segments[{a[5]}]: {a[3]}-byte pages "
            f"{a[1]} bytes apart overlap"
        )
    return None
