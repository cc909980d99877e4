"""The compiled table planner (pegaflow.kernels.table_jit) against the numpy
code it replaces on the launch path, on random tables: the block kernel's
checked and split table (plan.descriptor_table + plan.split_table), and a
copy-engine batch (the numpy merge and cut that dma.plan ran before, kept
here as the reference)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import Transfers
from pegaflow.common.runs import merge_adjacent
from pegaflow.copiers import dma
from pegaflow.kernels import table_jit
from pegaflow.kernels.plan import Buffer, descriptor_table, split_table

SPAN = 64 << 20


def _cut_at_edges(host, other, sizes, base, chunk):  # the numpy reference
    host, other, sizes = (a.astype(np.uint64) for a in (host, other, sizes))
    c = np.uint64(chunk)
    first = (host - np.uint64(base)) // c
    last = (host + sizes - np.uint64(1) - np.uint64(base)) // c
    pieces = (last - first + np.uint64(1)).astype(np.int64)
    row = np.repeat(np.arange(len(sizes)), pieces)
    k = np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    edge = np.uint64(base) + (first[row] + k.astype(np.uint64)) * c
    lo = np.maximum(host[row], edge)
    hi = np.minimum(host[row] + sizes[row], edge + c)
    return lo, other[row] + (lo - host[row]), hi - lo


def _reference_batch(src, dst, t, pool_chunks):
    descriptor_table(src, dst, t)
    keep = t.nbytes > 0
    (dsts, srcs), sizes = merge_adjacent([t.dst[keep], t.src[keep]], t.nbytes[keep])
    if pool_chunks is not None:
        base, chunk = pool_chunks
        pool_is_dst = dst.address <= base < dst.address + dst.nbytes
        host, other = (dsts, srcs) if pool_is_dst else (srcs, dsts)
        host, other, sizes = _cut_at_edges(host, other, sizes, base, chunk)
        dsts, srcs = (host, other) if pool_is_dst else (other, host)
    return [np.asarray(a, np.uint64).tolist() for a in (dsts, srcs, sizes)]


def _random_transfers(rng: np.random.Generator, src: Buffer, dst: Buffer) -> Transfers:
    """Pages at random or consecutive 64 KiB spots, equal or ragged sizes, now
    and then one out of range or overlapping another."""
    n = int(rng.integers(0, 48))
    size = int(rng.choice([16, 4096, 65536, 90000]))
    if rng.random() < 0.5:
        sizes = np.full(n, size, np.uint64)
    else:
        sizes = rng.integers(0, size + 1, n).astype(np.uint64)
    spots = 1000 if rng.random() < 0.7 else n
    so = rng.permutation(spots)[:n] if spots > n else np.arange(n)
    do = rng.permutation(spots)[:n] if rng.random() < 0.5 else np.sort(so)
    t = Transfers(
        so.astype(np.uint64) * np.uint64(65536) + np.uint64(src.address),
        do.astype(np.uint64) * np.uint64(65536) + np.uint64(dst.address),
        sizes,
    )
    if n and rng.random() < 0.08:
        t.dst[0] = np.uint64(dst.address - 16)  # below the buffer: wraps
    if n and rng.random() < 0.08:
        t.src[-1] = np.uint64(src.address + src.nbytes - 8)
    if n > 1 and rng.random() < 0.08:
        t.dst[1] = t.dst[0] + np.uint64(16)
    return t


def test_block_tables_match_descriptor_table_and_split_table() -> None:
    rng = np.random.default_rng(7)
    src = Buffer(1 << 24, 1 << 24, SPAN * 2, None, None)
    dst = Buffer(1 << 40, 1 << 40, SPAN * 2, None, None)
    refused = 0
    for _ in range(3000):
        t = _random_transfers(rng, src, dst)
        try:
            expected = descriptor_table(src, dst, t)
        except InternalError:
            expected = None
        if expected is None:  # the compiled check refuses, in the same words
            with pytest.raises(InternalError) as got_error:
                table_jit.checked_table(src, dst, t)
            with pytest.raises(InternalError) as want_error:
                descriptor_table(src, dst, t)
            assert str(got_error.value) == str(want_error.value)
            refused += 1
            continue
        got = table_jit.checked_table(src, dst, t)
        assert np.array_equal(got, expected)
        rows, min_piece = (
            int(rng.choice([1, 8, 100, 1056])),
            int(rng.choice([16, 4096])),
        )
        split = split_table(expected, rows, min_piece)
        n, piece = table_jit.split_rows(got, rows, min_piece)
        out = np.full((3, n + 5), -1, np.int64)
        table_jit.write_split(got, piece, out)
        assert n == split.shape[1]
        assert np.array_equal(out[:, :n], split) and (out[:, n:] == -1).all()
    assert 100 < refused < 1500  # both outcomes were exercised


@pytest.mark.parametrize("chunk", [None, 1 << 20, 3 << 16])
def test_copy_engine_batches_match_the_numpy_merge_and_cut(chunk: int | None) -> None:
    rng = np.random.default_rng(11)
    pool = Buffer(1 << 30, 1 << 30, SPAN * 2, None, None)
    engine = Buffer(1 << 40, 1 << 40, SPAN * 2, None, None)
    cuts = 0
    for i in range(1500):
        src, dst = (engine, pool) if i % 2 else (pool, engine)
        t = _random_transfers(rng, src, dst)
        chunks = None if chunk is None else (pool.address, chunk)
        try:
            expected = _reference_batch(src, dst, t, chunks)
        except InternalError as exc:
            with pytest.raises(InternalError, match=re.escape(str(exc))):
                dma.plan(src, dst, t, chunks)
            continue
        p = dma.plan(src, dst, t, chunks)
        assert [p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist()] == expected
        assert p.pages == len(t)
        cuts += len(p) > len(merge_adjacent([t.dst, t.src], t.nbytes)[1])
    assert chunk is None or cuts > 10  # edges were crossed


def _pages(starts: list[int], size: int, base: int) -> Transfers:
    n = len(starts)
    src = np.arange(n, dtype=np.uint64) * np.uint64(size) + np.uint64(1 << 24)
    dst = np.array(starts, np.uint64) + np.uint64(base)
    return Transfers(src, dst, np.full(n, size, np.uint64))


@pytest.mark.parametrize(
    ("case", "starts", "size", "dst_bytes"),
    [
        ("rising, apart", [0, 64, 256, 512], 64, SPAN),
        ("rising, one overlaps the next", [0, 64, 100, 512], 64, SPAN),
        ("rising, one start twice", [0, 64, 64, 512], 64, SPAN),
        ("unsorted pages, apart (the map)", [512, 0, 256, 64], 64, 4096),
        ("unsorted pages, one twice (the map)", [512, 0, 256, 0], 64, 4096),
        ("unsorted, other offsets mod the size", [512, 16, 256, 48], 64, 4096),
        ("unsorted, apart, other offsets", [512, 16, 256, 96], 64, 4096),
        ("unsorted, buffer too large for the map", [512, 0, 256, 0], 16, SPAN),
        ("unsorted, too large, apart", [512, 0, 256, 64], 16, SPAN),
    ],
)
def test_every_overlap_check_agrees_with_the_numpy_one(
    case: str, starts: list[int], size: int, dst_bytes: int
) -> None:
    """Each way the compiled check takes (one pass over rising destinations,
    the map of seen pages, the sort) refuses exactly what descriptor_table
    refuses: the map sees one start twice, the sort a partial overlap."""
    src = Buffer(1 << 24, 1 << 24, SPAN, None, None)
    dst = Buffer(1 << 40, 1 << 40, dst_bytes, None, None)
    t = _pages(starts, size, dst.address)
    try:
        want = descriptor_table(src, dst, t)
    except InternalError as e:
        with pytest.raises(InternalError, match=re.escape(str(e))):
            table_jit.checked_table(src, dst, t)
        return
    assert np.array_equal(table_jit.checked_table(src, dst, t), want), case


def test_a_load_of_many_pages_takes_the_map() -> None:
    """20,480 engine pages in a random block order (a 640-block load) pass,
    and the same with one block named twice is refused."""
    blocks, layers, page = 4096, 32, 65536
    dst = Buffer(1 << 40, 1 << 40, blocks * layers * page, None, None)
    src = Buffer(1 << 24, 1 << 24, 640 * layers * page, None, None)
    ids = np.random.default_rng(3).permutation(blocks)[:640]
    starts = (np.arange(layers)[None, :] * blocks + ids[:, None]) * page
    t = _pages(starts.ravel().tolist(), page, dst.address)
    assert table_jit.checked_table(src, dst, t).shape == (3, 640 * layers)
    t.dst[5 * layers] = t.dst[0]  # block 5's first page onto block 0's
    with pytest.raises(InternalError, match="overlaps"):
        table_jit.checked_table(src, dst, t)
