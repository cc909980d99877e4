"""Merging adjacent runs: the one helper for every copy or I/O plan that turns
many (address, length) pieces into fewer, larger requests.

A piece joins the one before it when, on every side it is described on (one side
for a file write's iovec; local and remote for process_vm_*; source and
destination offsets for a copy plan), it starts exactly where the previous piece
ended. Pieces are never reordered, so the merged plan moves the same bytes in
the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Part = tuple[int, int]  # (address or offset, bytes)


def merge_adjacent(
    starts: Sequence[np.ndarray], nbytes: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray]:
    """Merge each piece into the previous one where every side continues it.

    starts: one integer array per side, the start of each piece on that side
    (all of len(nbytes)); nbytes: each piece's length, the same on every side.
    Returns (the merged pieces' starts per side, their lengths). Vectorised:
    a few numpy operations whatever the number of pieces."""
    nbytes = np.asarray(nbytes)
    if len(nbytes) < 2:
        return [np.asarray(s) for s in starts], nbytes
    joins = np.ones(len(nbytes) - 1, bool)
    for side in starts:
        side = np.asarray(side)
        joins &= side[1:] == side[:-1] + nbytes[:-1]
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = [np.asarray(s)[first] for s in starts]
    return merged, np.add.reduceat(nbytes, first)


def merge_parts(parts: Sequence[Part]) -> list[Part]:
    """merge_adjacent over one side, as a list of (address, bytes) tuples of
    Python ints (an iovec for pwritev / preadv)."""
    if len(parts) < 2:
        return list(parts)
    table = np.array(parts, np.uint64)
    (addr,), n = merge_adjacent([table[:, 0]], table[:, 1])
    return list(zip(addr.tolist(), n.tolist(), strict=True))
