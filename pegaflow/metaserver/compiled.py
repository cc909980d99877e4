"""The metaserver's two hot loops compiled (numba), where numba is installed:
RowTable.find and BlockIndex.prefix's plan.

On the dev VM a 1,000-hash lookup over a 2M-entry index took ~150 µs in
RowTable.find's numpy rounds (the fold, the home-slot gathers, the record
check and the window rounds: about thirty array calls and their temporaries),
most of a QueryPrefix's own work; on the H200 host, where the same Python is
slower after an idle gap, that work is what stood between the metaserver and
a 1 ms P50 (benchmarks/RESULTS.md, issue 11). This is the same lookup, key by
key: the fold of open_addressing.keyed_fold, the home slot, a linear probe to
the first EMPTY slot, and each key match checked against the whole record.
A first loop computes every key's home, so the probes' cache misses are
independent loads the CPU can overlap.

The plan (_plan_into) is BlockIndex.prefix's after the lookup: the rows up
to the first unknown hash or the first one no owner but the asker holds,
then at each segment's start the owner with the longest unbroken run (ties
to the lowest node slot), as _plan_by_node and _plan_by_entry compute it
with a few dozen array calls.

numba is an optional dependency (the `cuda` extra): without it `find()` and
`plan()` are None and the numpy code runs. tests/metaserver/test_compiled.py
compares both on random tables with tombstones, long runs and colliding
namespaces, and on random owner matrices.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.open_addressing import EMPTY, FOLD_SHIFT

logger = logging.getLogger(__name__)


def _find_into(
    slots: np.ndarray,
    rec: np.ndarray,
    words: np.ndarray,
    length: np.uint64,
    namespace: np.uint64,
    word_mults: np.ndarray,
    length_mult: np.uint64,
    namespace_mult: np.uint64,
    home_mult: np.uint64,
    home_shift: np.uint64,
    found: np.ndarray,
) -> None:
    """found[i]: the row filed for hash i (words[i], `length` bytes) in
    `namespace`, else -1."""
    n = words.shape[0]
    shift = np.uint64(FOLD_SHIFT)
    width = min((length + np.uint64(7)) // np.uint64(8), np.uint64(words.shape[1]))
    start = length * length_mult
    start ^= start >> shift
    start = (start ^ namespace) * namespace_mult
    start ^= start >> shift
    keys = np.empty(n, np.uint64)
    homes = np.empty(n, np.int64)
    for i in range(n):
        acc = start
        for j in range(width):
            acc = (acc ^ words[i, j]) * word_mults[j]
            acc ^= acc >> shift
        keys[i] = acc
        homes[i] = np.int64((acc * home_mult) >> home_shift)
    signed = keys.view(np.int64)
    # Most keys sit in their home slot: its row, then that row's record head,
    # each read for every key before any is used, so the misses overlap.
    # home_rows: the row where the slot's key is the key's, EMPTY where the
    # slot is (the key is not filed), else -1 (probe on).
    home_rows = np.empty(n, np.int64)
    for i in range(n):
        row = slots[homes[i], 1]
        if row >= 0 and slots[homes[i], 0] != signed[i]:
            row = -1
        home_rows[i] = max(row, np.int64(EMPTY))
    heads = np.zeros(n, np.uint64)
    for i in range(n):
        if home_rows[i] >= 0:
            heads[i] = rec[home_rows[i], 0]
    head = length | (namespace << np.uint64(8))
    compared = min(words.shape[1], rec.shape[1] - 1)
    end = slots.shape[0]
    for i in range(n):
        found[i] = -1
        row, row_head, pos = home_rows[i], heads[i], homes[i]
        if row == EMPTY:
            continue
        while True:
            if row >= 0 and row_head == head:  # the key's: is it the whole hash?
                same = True
                for j in range(compared):
                    if rec[row, 1 + j] != words[i, j]:
                        same = False
                        break
                if same:
                    found[i] = row
                    break
            pos += 1
            if pos == end:  # never: the last slots stay empty
                break
            row = slots[pos, 1]
            if row == EMPTY:  # the run ends: not filed
                break
            if row >= 0 and slots[pos, 0] == signed[i]:
                row_head = rec[row, 0]
            else:
                row = -1


def _plan_into(
    found: np.ndarray,
    owners: np.ndarray,
    exclude: int,
    seg_nodes: np.ndarray,
    seg_blocks: np.ndarray,
) -> int:
    """The plan's segments into seg_nodes / seg_blocks; returns their count.
    found: the query's rows (-1: unknown); owners: [rows, ways] node slots,
    negative where a way is empty."""
    ways = owners.shape[1]
    n = 0
    while n < found.shape[0]:
        row = found[n]
        if row < 0:
            break
        held = False
        for w in range(ways):
            node = owners[row, w]
            if node >= 0 and node != exclude:
                held = True
                break
        if not held:
            break
        n += 1
    segments = 0
    i = 0
    while i < n:
        best_node, best_run = -1, 0
        row = found[i]
        for w in range(ways):
            node = owners[row, w]
            if node < 0 or node == exclude:
                continue
            k = i + 1
            while k < n:
                held = False
                for v in range(ways):
                    if owners[found[k], v] == node:
                        held = True
                        break
                if not held:
                    break
                k += 1
            if k - i > best_run or (k - i == best_run and node < best_node):
                best_node, best_run = node, k - i
        seg_nodes[segments] = best_node
        seg_blocks[segments] = best_run
        segments += 1
        i += best_run
    return segments


def _numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        logger.info("numba is not installed: the metaserver's lookups run in numpy")
        return False
    return True


@functools.cache
def plan() -> Callable[..., Any] | None:
    """_plan_into compiled (or loaded from numba's cache), None without numba."""
    if not _numba():
        return None
    from numba import types

    from pegaflow.common.jit import njit

    signature = types.int64(
        types.int64[:],  # found
        types.int32[:, :],  # owners
        types.int64,  # exclude
        types.int64[:],  # segments' nodes (out)
        types.int64[:],  # segments' blocks (out)
    )
    return njit(_plan_into, signature, nogil=True)


@functools.cache
def find() -> Callable[..., Any] | None:
    """_find_into compiled (or loaded from numba's cache), None without numba."""
    if not _numba():
        return None
    from numba import types

    from pegaflow.common.jit import njit

    u64 = types.uint64
    # The words are a view of the request's bytes: read-only, any strides.
    words = types.Array(u64, 2, "A", readonly=True)
    signature = types.void(
        types.int64[:, :],  # slots
        u64[:, :],  # records
        words,
        u64,  # length
        u64,  # namespace
        u64[:],  # the words' multipliers
        u64,  # the length's
        u64,  # the namespace's
        u64,  # the home slot's
        u64,  # the home shift
        types.int64[:],  # found (out)
    )
    return njit(_find_into, signature, nogil=True)
