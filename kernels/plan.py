"""Backend-neutral half of the kernels: buffers, checked descriptor tables and
their split into pieces. numpy only, so the CPU twin, the CUDA backend and the
simulator tests share every line of validation and planning.

A `Buffer` is a byte range the copy may touch, named twice: `address` is how
`Transfers` name its bytes (a device pointer for engine memory, a host virtual
address for the mapped pool), `device_address` is where a kernel reaches them.
Kernels see descriptors only as offsets into a source and a destination
buffer; `descriptor_table` turns absolute `Transfers` into those offsets after
checking that every range lies inside its buffer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import Transfers

Width = Literal[1, 8, 16]
WIDTHS = (1, 8, 16)
ALIGN = 16  # buffer bases must allow the widest store
PIECE_ALIGN = 16  # split pieces keep each offset modulo the widest store


@dataclass(frozen=True, slots=True)
class Buffer:
    """Bytes a copy may touch. The real CUDA kernels take `device_address`;
    `data` (uint8) and `words` (uint64) are array views for the CPU twin and
    the simulator, None where unused."""

    address: int
    device_address: int
    nbytes: int
    data: Any
    words: Any
    owner: Any = None  # keeps the memory alive while the buffer is used


def check_buffer(address: int, device_address: int, nbytes: int) -> None:
    """A buffer must be a real, 16-byte aligned range (the 16-byte path needs it)."""
    if nbytes < ALIGN:
        raise InternalError(f"nbytes: {nbytes}, need at least {ALIGN}")
    for field, value in (("address", address), ("device_address", device_address)):
        if value <= 0 or value + nbytes > 1 << 64:
            raise InternalError(f"{field}: {value:#x} (+{nbytes}) is not a range")
        if value % ALIGN:
            raise InternalError(f"{field}: {value:#x} is not {ALIGN}-byte aligned")


def check_launch(width: int, max_blocks: int | None) -> None:
    if width not in WIDTHS:
        raise InternalError(f"width: {width}, need one of {WIDTHS}")
    if max_blocks is not None and max_blocks < 1:
        raise InternalError(f"max_blocks: {max_blocks}, need >= 1 or None")


def descriptor_table(src: Buffer, dst: Buffer, t: Transfers) -> np.ndarray:
    """int64 [3, n]: rows src offset, dst offset, nbytes; every range checked."""
    check_arrays(t)
    table = np.empty((3, len(t)), np.uint64)
    np.subtract(t.src, np.uint64(src.address), out=table[0])  # wraps below base:
    np.subtract(t.dst, np.uint64(dst.address), out=table[1])  # caught as too big
    table[2] = t.nbytes
    _check_inside("transfers.src", table[0], t.nbytes, src.nbytes)
    _check_inside("transfers.dst", table[1], t.nbytes, dst.nbytes)
    _check_disjoint("transfers.dst", table[1], t.nbytes)
    return table.view(np.int64)  # offsets < 2**63 once inside a buffer


def check_arrays(t: Transfers) -> None:
    if not isinstance(t, Transfers):
        raise InternalError(f"transfers: expected Transfers, got {type(t).__name__}")
    n = None
    for field in ("src", "dst", "nbytes"):
        a = getattr(t, field)
        if not isinstance(a, np.ndarray) or a.dtype != np.uint64 or a.ndim != 1:
            what = getattr(a, "dtype", type(a).__name__)
            raise InternalError(f"transfers.{field}: need 1-D uint64, got {what}")
        if n is not None and len(a) != n:
            raise InternalError(f"transfers.{field}: {len(a)} rows, src has {n}")
        n = len(a)


def _check_inside(field: str, off: np.ndarray, nbytes: np.ndarray, size: int) -> None:
    cap = np.uint64(size)
    bad = (off > cap) | (nbytes > cap - off)  # no overflow: off <= cap when read
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InternalError(
            f"{field}[{i}]: {int(nbytes[i])} bytes at offset {int(off[i])} "
            f"(wrapped if huge) leave the {size}-byte buffer"
        )


def _check_disjoint(field: str, off: np.ndarray, nbytes: np.ndarray) -> None:
    """Overlapping destinations would race between CUDA blocks: refuse them."""
    if len(off) < 2:
        return
    if nbytes.min() == nbytes.max():  # the usual case: a plain sort will do
        # Stable (timsort): a block's pages come as one ascending run, which it
        # merges; 640 blocks x 32 pages 113-177 us against quicksort's ~600
        # (dev VM; on shuffled offsets it would be 842 against 577).
        start = np.sort(off, kind="stable")
        if not (np.diff(start) < nbytes[0]).any():
            return
    order = np.argsort(off, kind="stable")
    start = off[order]
    end = start + nbytes[order]
    clash = np.flatnonzero(end[:-1] > start[1:])
    if clash.size:
        i = int(order[clash[0] + 1])
        raise InternalError(f"{field}[{i}]: overlaps another destination range")


def split_table(table: np.ndarray, rows: int, min_piece: int) -> np.ndarray:
    """Cut descriptors into pieces until the table has about `rows` of them.

    The kernel gives each descriptor one CUDA block, so a small request (one
    block: 32 pages) would otherwise run on 32 SMs. Pieces are multiples of 16
    bytes and at least `min_piece`, so alignment and store width are kept.
    """
    n = table.shape[1]
    if n == 0 or n >= rows:
        return table
    piece = max(min_piece, -(-int(table[2].sum()) // rows))
    piece = -(-piece // PIECE_ALIGN) * PIECE_ALIGN
    size = int(table[2, 0])
    if size > 0 and size % piece == 0 and (table[2] == size).all():
        # The usual small request (one block: 32 equal pages): every page cut
        # into the same pieces by one broadcast add instead of ~15 numpy calls
        # (37 -> ~7 us on the dev VM; a 1-block copy is ~100 us on the H200).
        return _split_even(table, size // piece, piece)
    counts = np.maximum(1, -(-table[2] // piece))
    if (counts == 1).all():
        return table
    idx = np.repeat(np.arange(n), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    skip = (np.arange(len(idx)) - first) * piece
    out = table[:, idx]
    out[0] += skip
    out[1] += skip
    out[2] = np.minimum(out[2] - skip, piece)
    return out


def _split_even(table: np.ndarray, cuts: int, piece: int) -> np.ndarray:
    """Each descriptor of `table` (all `cuts * piece` bytes) as `cuts` pieces
    in order, as the general path of split_table orders them: one broadcast
    add of a cached [3, 1, cuts] step."""
    if cuts == 1:
        return table
    step = _even_step(cuts, piece, int(table[2, 0]))
    return np.add(table[:, :, None], step, dtype=np.int64).reshape(3, -1)


@functools.lru_cache(maxsize=64)
def _even_step(cuts: int, piece: int, size: int) -> np.ndarray:
    """Added to a descriptor (src, dst, size): each piece's offsets and size."""
    step = np.zeros((3, 1, cuts), np.int64)
    step[0, 0] = step[1, 0] = np.arange(0, cuts * piece, piece)
    step[2, 0] = piece - size
    step.setflags(write=False)
    return step


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """A uint8 array whose first byte sits on an `align` boundary."""
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes]
