"""A copy's descriptor table checked, split and written in one compiled call.

On the H200 host (benchmarks/RESULTS.md, 2026-12-02, seventh session) the
host side of a 1-block load's launch took ~100 µs in the server, the GPU copy
~43: about twenty small numpy calls (descriptor_table's range and overlap
checks, split_table, the fill of the mapped table), each a few µs once the
core comes back from idle. Here the same work is one numba-compiled loop over
the descriptors (nopython; the overlap check's sort order is its one array),
written straight into the launch's table.

Same results as plan.descriptor_table + plan.split_table by construction of
the tests (tests/kernels/test_table_jit.py compares them on random tables);
on any failed check the numpy check runs again and raises the error naming
the field and index (checked_table).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.errors import InternalError
from pegaflow.common.jit import njit

from .plan import PIECE_ALIGN, check_arrays, descriptor_table

logger = logging.getLogger(__name__)

OK, OUT_OF_RANGE, OVERLAP = 0, -1, -2
# The overlap check's map of seen pages: at most this many cells, or this
# many per descriptor (an engine buffer of 8 GiB in 64 KiB pages: 131,072).
SEEN_MIN_CELLS = 1 << 18
SEEN_CELLS_PER_ROW = 64


def _check_into(
    src_base: np.uint64,
    src_size: np.uint64,
    dst_base: np.uint64,
    dst_size: np.uint64,
    t_src: np.ndarray,
    t_dst: np.ndarray,
    t_nbytes: np.ndarray,
    table: np.ndarray,
) -> int:
    """table[:, :n] = (src offset, dst offset, nbytes); OK, or OUT_OF_RANGE /
    OVERLAP as descriptor_table would refuse the same transfers.

    The overlap check takes the cheapest way the table allows: one pass when
    the destinations come in rising order (a save's slots), a map of seen
    pages when all descriptors have one size and destinations one offset
    modulo it (a load's engine pages: two such ranges overlap only when they
    start at the same byte), a sort otherwise. A sort of 20,480 pages took
    ~0.8-2 ms on the dev VM, before the launch, with the GPU idle."""
    n = t_src.shape[0]
    rising = True
    same = n > 0 and t_nbytes[0] > 0  # one size, one offset modulo it
    size = max(np.int64(1), np.int64(t_nbytes[0])) if n > 0 else np.int64(1)
    for k in range(n):
        so = t_src[k] - src_base  # uint64: below the base wraps to huge
        do = t_dst[k] - dst_base
        nb = t_nbytes[k]
        if so > src_size or nb > src_size - so:
            return OUT_OF_RANGE
        if do > dst_size or nb > dst_size - do:
            return OUT_OF_RANGE
        table[0, k] = np.int64(so)
        table[1, k] = np.int64(do)
        table[2, k] = np.int64(nb)
        if k > 0:
            rising = rising and table[1, k] >= table[1, k - 1]
            same = (
                same and nb == t_nbytes[0] and (table[1, k] - table[1, 0]) % size == 0
            )
    if n < 2:
        return OK
    if rising:
        for k in range(n - 1):
            if table[1, k] + table[2, k] > table[1, k + 1]:
                return OVERLAP
        return OK
    cells = np.int64(dst_size) // size + 1
    if same and cells <= max(SEEN_MIN_CELLS, SEEN_CELLS_PER_ROW * n):
        seen = np.zeros(cells, np.uint8)
        for k in range(n):
            c = table[1, k] // size
            if seen[c]:
                return OVERLAP
            seen[c] = 1
        return OK
    order = np.argsort(table[1, :n], kind="mergesort")
    for j in range(n - 1):
        a, b = order[j], order[j + 1]
        if table[1, a] + table[2, a] > table[1, b]:
            return OVERLAP
    return OK


def _split_count(
    table: np.ndarray, n: int, rows: int, min_piece: int
) -> tuple[int, int]:
    """(rows after splitting, piece bytes; 0: no split), as split_table."""
    if n == 0 or n >= rows:
        return n, 0
    total = 0
    for k in range(n):
        total += table[2, k]
    piece = max(min_piece, -(-total // rows))
    piece = -(-piece // PIECE_ALIGN) * PIECE_ALIGN
    out = 0
    for k in range(n):
        out += max(1, -(-table[2, k] // piece))
    if out == n:
        return n, 0
    return out, piece


def _split_into(table: np.ndarray, n: int, piece: int, out: np.ndarray) -> None:
    """Each descriptor cut into `piece`-byte pieces, in order (the last of
    each is the rest), as split_table cuts them."""
    r = 0
    for k in range(n):
        s, d, size = table[0, k], table[1, k], table[2, k]
        skip = 0
        while True:
            out[0, r] = s + skip
            out[1, r] = d + skip
            out[2, r] = min(size - skip, piece)
            r += 1
            skip += piece
            if skip >= size:
                break


def _merge_cut(
    t_dst: np.ndarray,
    t_src: np.ndarray,
    t_nbytes: np.ndarray,
    pool_is_dst: bool,
    base: np.uint64,
    chunk: np.uint64,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A copy-engine batch's copies (dsts, srcs, sizes, absolute addresses):
    empty descriptors dropped, each merged into the one before it where both
    sides continue it, then cut where the pool side crosses base + k * chunk
    (chunk 0: no cut). Order kept."""
    n = t_dst.shape[0]
    total = np.uint64(0)
    for k in range(n):
        total += t_nbytes[k]
    # A run of s bytes crosses at most s // chunk + 1 edges: s // chunk + 2 pieces.
    bound = 2 * n + 1 + (0 if chunk == 0 else np.int64(total // chunk))
    dsts = np.empty(bound, np.uint64)
    srcs = np.empty(bound, np.uint64)
    sizes = np.empty(bound, np.uint64)
    m = 0  # merged runs, cut below in place from the end: first merge
    for k in range(n):
        nb = t_nbytes[k]
        if nb == 0:
            continue
        if (
            m
            and dsts[m - 1] + sizes[m - 1] == t_dst[k]
            and (srcs[m - 1] + sizes[m - 1] == t_src[k])
        ):
            sizes[m - 1] += nb
            continue
        dsts[m], srcs[m], sizes[m] = t_dst[k], t_src[k], nb
        m += 1
    if chunk == 0:
        return dsts[:m], srcs[:m], sizes[:m]
    out_d = np.empty(bound, np.uint64)
    out_s = np.empty(bound, np.uint64)
    out_n = np.empty(bound, np.uint64)
    r = 0
    for k in range(m):
        host = dsts[k] if pool_is_dst else srcs[k]
        other = srcs[k] if pool_is_dst else dsts[k]
        left = sizes[k]
        while left > 0:
            edge = base + ((host - base) // chunk + np.uint64(1)) * chunk
            take = min(left, edge - host)
            out_d[r] = host if pool_is_dst else other
            out_s[r] = other if pool_is_dst else host
            out_n[r] = take
            r += 1
            host += take
            other += take
            left -= take
    return out_d[:r], out_s[:r], out_n[:r]


_compiled: tuple[Callable[..., Any], ...] | None = None
_compile_lock = threading.Lock()


def compiled() -> tuple[Callable[..., Any], ...]:
    """(check_into, split_count, split_into, merge_cut), numba-compiled (cached on disk;
    the first call of a process compiles or loads them, once for all threads)."""
    global _compiled
    got = _compiled
    if got is None:
        with _compile_lock:
            got = _compiled = _compiled or _compile()
    return got


def ready() -> bool:
    """Whether compiled() returns at once (pegaflow.kernels.cuda checks
    tables with plan's numpy twins until then)."""
    return _compiled is not None


def load_in_background() -> None:
    """compiled() on a thread: `import numba` and loading its cache took
    1.0-1.4 s of a GPU engine's wait after a restart on the H200
    (benchmarks/RESULTS.md, "Warm restart"), where the first copies need
    only the numpy checks. A failure is logged; callers of compiled() then
    meet it themselves."""

    def load() -> None:
        try:
            compiled()
        except Exception:
            logger.exception("the descriptor checks' compiled loops did not load")

    if _compiled is None:
        threading.Thread(target=load, name="pegaflow-table-jit", daemon=True).start()


def _compile() -> tuple[Callable[..., Any], ...]:

    # Explicit signatures: compiled (or loaded from the cache) here, at the
    # server's start, never on a first copy; any array layout is accepted.
    def jit(signature: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        # Bounds checked: a wrong index is an IndexError, never a write
        # outside a table (the cost is not measurable at these sizes).
        return njit(fn, signature, nogil=True, boundscheck=True)

    return (
        jit(
            "int64(uint64, uint64, uint64, uint64, uint64[:], uint64[:], "
            "uint64[:], int64[:, :])",
            _check_into,
        ),
        jit("UniTuple(int64, 2)(int64[:, :], int64, int64, int64)", _split_count),
        jit("void(int64[:, :], int64, int64, int64[:, :])", _split_into),
        jit(
            "UniTuple(uint64[::1], 3)(uint64[:], uint64[:], uint64[:], boolean, "
            "uint64, uint64)",
            _merge_cut,
        ),
    )


compiled.__wrapped__ = _compile  # type: ignore[attr-defined]  # a fresh compile


def checked_table(src: Any, dst: Any, t: Any) -> np.ndarray:
    """descriptor_table's int64 [3, n] (src offset, dst offset, nbytes), every
    range checked, by one compiled call; InternalError naming the field and
    index where a check fails, in descriptor_table's words (the numpy check
    runs again to say it; the two agree)."""
    check_arrays(t)
    table = np.empty((3, len(t.src)), np.int64)
    status = compiled()[0](
        np.uint64(src.address), np.uint64(src.nbytes),
        np.uint64(dst.address), np.uint64(dst.nbytes),
        t.src, t.dst, t.nbytes, table,
    )  # fmt: skip
    if status != OK:
        descriptor_table(src, dst, t)
        raise InternalError("transfers: refused by the compiled check only")
    return table


def split_rows(table: np.ndarray, rows: int, min_piece: int) -> tuple[int, int]:
    """(rows after splitting, piece bytes; 0: no split), as split_table."""
    return compiled()[1](table, table.shape[1], rows, min_piece)


def write_split(table: np.ndarray, piece: int, out: np.ndarray) -> None:
    """`table` split by `piece` (0: as it is) into out[:, :rows]."""
    if piece == 0:
        out[:, : table.shape[1]] = table
    else:
        compiled()[2](table, table.shape[1], piece, out)


def merge_cut(
    t: Any, pool_is_dst: bool, base: int, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_merge_cut of a checked Transfers: (dsts, srcs, sizes) of the batch."""
    return compiled()[3](
        t.dst, t.src, t.nbytes, pool_is_dst, np.uint64(base), np.uint64(chunk)
    )
