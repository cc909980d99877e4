"""Backend-neutral half of the kernels: buffers, checked descriptor tables and
staging plans. numpy only, so the CPU twin, the CUDA backend and the simulator
tests share every line of validation and planning.

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
from pegaflow.common.runs import merge_adjacent

Width = Literal[1, 8, 16]
Direction = Literal["gather", "scatter"]
KernelKind = Literal["block", "warp"]
WIDTHS = (1, 8, 16)
MAX_THREADS = 1024  # CUDA's limit on threads per block
ALIGN = 16  # buffer bases must allow the widest store
STAGE_ALIGN = 16
MAX_PARTS = 16  # staging parts in turn (the CUDA backend's event rotation)


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


@dataclass(frozen=True, slots=True)
class LaunchShape:
    """Which copy kernel runs and how it is cut up (the CPU twin ignores it).

    "block" (the default, the first kernel): each CUDA block takes one
    descriptor at a time; small requests are split on the host. "warp": each
    warp takes one piece of a descriptor (`parts` pieces per descriptor, None =
    enough to give every warp of the grid work), no shared memory or block
    barriers; it is also the kernel that can move two tables (a save and a
    load) in one launch. `threads` per CUDA block, None = the backend's default.
    """

    kernel: KernelKind = "block"
    threads: int | None = None
    parts: int | None = None

    def __post_init__(self) -> None:
        if self.kernel not in ("block", "warp"):
            raise InternalError(f"shape.kernel: {self.kernel!r}, need block|warp")
        t = self.threads
        if t is not None and not (32 <= t <= MAX_THREADS and t % 32 == 0):
            raise InternalError(f"shape.threads: {t}, need a multiple of 32 <= 1024")
        if self.parts is not None and self.parts < 1:
            raise InternalError(f"shape.parts: {self.parts}, need >= 1 or None")


@dataclass(frozen=True, slots=True)
class StageChunk:
    """One staging round: `table` for the kernel, `runs` for the DMA copies.

    Both are int64 [3, k] tables: rows from offset, to offset, nbytes. A gather
    runs the kernel device -> staging, then the runs staging -> host; a scatter
    the runs host -> staging, then the kernel staging -> device.
    """

    table: np.ndarray
    runs: np.ndarray


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
    piece = -(-piece // STAGE_ALIGN) * STAGE_ALIGN
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


def stage_chunks(
    table: np.ndarray, capacity: int, direction: Direction
) -> list[StageChunk]:
    """Pack a checked table into staging space, in rounds of `capacity` bytes.

    `table` is descriptor_table's; the device side is src for a gather and dst
    for a scatter. Each round's `runs` are maximal stretches contiguous in both
    staging and host memory: one DMA copy each. A descriptor keeps its
    device-side offset modulo 16 in staging, so the kernel's 16-byte path stays
    open; aligned pages pack back to back and their runs merge.
    """
    if capacity < STAGE_ALIGN:
        raise InternalError(f"staging: capacity {capacity} is below {STAGE_ALIGN}")
    dev_row, host_row = (0, 1) if direction == "gather" else (1, 0)
    table = table[:, table[2] > 0]
    nbytes = table[2]
    skew = table[dev_row] % STAGE_ALIGN
    padded = (skew + nbytes + STAGE_ALIGN - 1) // STAGE_ALIGN * STAGE_ALIGN
    if padded.size and padded.max() > capacity:
        i = int(np.argmax(padded))
        raise InternalError(
            f"transfers.nbytes: {int(nbytes[i])} bytes in one descriptor exceed "
            f"the {capacity}-byte staging buffer"
        )
    slot_end = np.cumsum(padded)
    slot_base = slot_end - padded
    chunks = []
    start = 0
    while start < len(nbytes):  # one pass per staging round, not per descriptor
        base = slot_base[start]
        stop = int(np.searchsorted(slot_end, base + capacity, side="right"))
        part = table[:, start:stop]
        stage = slot_base[start:stop] - base + skew[start:stop]
        kernel = part.copy()
        kernel[host_row] = stage
        runs = _runs(part[host_row], stage, part[2])
        if direction == "scatter":
            runs = runs[[1, 0, 2]]  # DMA goes host -> staging
        chunks.append(StageChunk(kernel, runs))
        start = stop
    return chunks


@dataclass(frozen=True, slots=True)
class StageRounds:
    """stage_chunks' rounds placed in a staging buffer cut into parts: round
    i's staging offsets already point into part i % len(bases), which starts
    at bases[i % len(bases)]."""

    chunks: list[StageChunk]
    bases: tuple[int, ...]


def stage_rounds(
    table: np.ndarray,
    capacity: int,
    direction: Direction,
    parts: int = 1,
    round_bytes: int | None = None,
) -> StageRounds:
    """stage_chunks over `parts` equal, 16-byte aligned parts of a `capacity`
    byte staging buffer, rounds of at most `round_bytes` (a part's size when
    None): while one part's runs cross PCIe the next part packs or unpacks."""
    if not 1 <= parts <= MAX_PARTS:
        raise InternalError(f"parts: {parts}, need 1..{MAX_PARTS}")
    part = capacity // parts // STAGE_ALIGN * STAGE_ALIGN
    if round_bytes is not None:
        if round_bytes < STAGE_ALIGN:
            raise InternalError(f"round_bytes: {round_bytes}, need >= {STAGE_ALIGN}")
        part = min(part, round_bytes // STAGE_ALIGN * STAGE_ALIGN)
    chunks = stage_chunks(table, part, direction)
    bases = tuple(i * part for i in range(min(parts, max(1, len(chunks)))))
    stage_row = 1 if direction == "gather" else 0  # the kernel's staging side
    run_row = 0 if direction == "gather" else 1  # the runs' staging side
    for i, chunk in enumerate(chunks):
        base = bases[i % len(bases)]
        if base:
            chunk.table[stage_row] += base
            chunk.runs[run_row] += base
    return StageRounds(chunks, bases)


def _runs(host: np.ndarray, stage: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """[3, k]: staging offset, host offset, nbytes of each contiguous stretch."""
    (stage, host), nbytes = merge_adjacent([stage, host], nbytes)
    return np.stack([stage, host, nbytes])


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """A uint8 array whose first byte sits on an `align` boundary."""
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes]
