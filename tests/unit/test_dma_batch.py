"""Copy-engine batches without a GPU: the planner's arrays (pegaflow.copiers.dma)
and the ctypes binding, called on a stand-in for libcuda's entry point (a real
C-callable made by ctypes.CFUNCTYPE from Python), never a stub of our server."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pegaflow.common.cuda_driver import CudaError
from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import Transfers
from pegaflow.copiers import dma
from pegaflow.kernels import backend
from pegaflow.kernels.plan import Buffer, aligned_empty

PAGE = 4096
cpu = backend("cpu")

V = ctypes.c_void_p
SZ = ctypes.c_size_t
V2 = ctypes.CFUNCTYPE(ctypes.c_int, V, V, V, SZ, V, V, SZ, V)  # CUDA 13
V1 = ctypes.CFUNCTYPE(ctypes.c_int, V, V, V, SZ, V, V, SZ, V, V)  # 12.8: failIdx


def _buffer(nbytes: int, rng: np.random.Generator | None = None) -> Buffer:
    mem = aligned_empty(nbytes)
    mem[:] = rng.integers(0, 256, nbytes, np.uint8) if rng is not None else 0xAB
    return cpu.wrap(mem.ctypes.data, nbytes, owner=mem)


def _words(address: int | None, count: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(address or 0, 8 * count), np.uint64).copy()


def _pages(
    src: Buffer, dst: Buffer, src_pages: np.ndarray, dst_pages: np.ndarray
) -> Transfers:
    n = len(src_pages)
    return Transfers(
        np.uint64(src.address) + src_pages.astype(np.uint64) * np.uint64(PAGE),
        np.uint64(dst.address) + dst_pages.astype(np.uint64) * np.uint64(PAGE),
        np.full(n, PAGE, np.uint64),
    )


class FakeLib:
    """libcuda's batch entry point, recording each call's arguments as bytes;
    with `execute`, it also moves the bytes (memmove: host memory here)."""

    def __init__(self, legacy: bool = False, status: int = 0, fail_at: int = 0):
        self.calls: list[dict[str, Any]] = []
        self.execute = False
        self._status, self._fail_at = status, fail_at
        if legacy:
            self.cuMemcpyBatchAsync = V1(self._legacy)
        else:
            self.cuMemcpyBatchAsync_v2 = V2(self._v2)

    def _v2(self, dsts: int, srcs: int, sizes: int, count: int, *rest: Any) -> int:
        attrs, idxs, nattrs, stream = rest
        call = dict(
            dsts=_words(dsts, count),
            srcs=_words(srcs, count),
            sizes=_words(sizes, count),
            attrs=ctypes.string_at(attrs, ctypes.sizeof(dma.MemcpyAttributes)),
            idxs=_words(idxs, nattrs),
            stream=stream,
        )
        self.calls.append(call)
        if self.execute:
            for d, s, n in zip(call["dsts"], call["srcs"], call["sizes"], strict=True):
                ctypes.memmove(int(d), int(s), int(n))
        return self._status

    def _legacy(self, dsts: int, srcs: int, sizes: int, count: int, *rest: Any) -> int:
        *args, fail, stream = rest
        ctypes.c_size_t.from_address(fail).value = self._fail_at
        return self._v2(dsts, srcs, sizes, count, *args, stream)


def test_plan_merges_runs_and_moves_the_same_bytes() -> None:
    """Random pages with some contiguous stretches: the plan merges exactly
    the stretches contiguous on both sides (counted here by a plain loop), and
    executing it moves every byte the unmerged table moves."""
    rng = np.random.default_rng(7)
    src = _buffer(256 * PAGE, rng)
    src_pages = np.concatenate([np.arange(10, 18), rng.permutation(200)[:40] + 50])
    dst_pages = np.concatenate([np.arange(100, 108), rng.permutation(90)[:40]])
    src_pages[20:23] = [5, 6, 7]  # a second stretch of 3, contiguous in dst too
    dst_pages[20:23] = [200, 201, 202]
    want_dst, got_dst = _buffer(256 * PAGE), _buffer(256 * PAGE)
    t = _pages(src, got_dst, src_pages, dst_pages)

    p = dma.plan(src, got_dst, t)
    runs = 1 + sum(
        not (
            src_pages[i] == src_pages[i - 1] + 1
            and dst_pages[i] == dst_pages[i - 1] + 1
        )
        for i in range(1, len(src_pages))
    )
    assert len(p) == runs and p.pages == len(t)
    for a in (p.dsts, p.srcs, p.sizes):
        assert a.dtype == np.uint64 and a.flags.c_contiguous
    assert int(p.sizes.sum()) == t.total_bytes

    lib = FakeLib()
    lib.execute = True
    dma.bind(lib)(p, dma.attributes("save", 0), 0x5150)
    cpu.copy_descriptors(
        src, want_dst, _pages(src, want_dst, src_pages, dst_pages), stream=None
    )
    assert bytes(got_dst.data) == bytes(want_dst.data)


def test_plan_of_contiguous_ids_is_one_copy() -> None:
    src, dst = _buffer(64 * PAGE), _buffer(64 * PAGE)
    p = dma.plan(src, dst, _pages(src, dst, np.arange(3, 35), np.arange(20, 52)))
    assert p.sizes.tolist() == [32 * PAGE]
    assert p.srcs.tolist() == [src.address + 3 * PAGE]
    assert p.dsts.tolist() == [dst.address + 20 * PAGE]


def test_plan_drops_empty_rows_and_keeps_the_kernels_checks() -> None:
    src, dst = _buffer(16 * PAGE), _buffer(16 * PAGE)
    t = _pages(src, dst, np.array([0, 4, 9]), np.array([1, 7, 3]))
    t.nbytes[1] = 0
    assert dma.plan(src, dst, t).sizes.tolist() == [PAGE, PAGE]
    outside = _pages(src, dst, np.array([0, 16]), np.array([0, 1]))
    with pytest.raises(InternalError, match=r"transfers.src\[1\]"):
        dma.plan(src, dst, outside)
    overlap = _pages(src, dst, np.array([0, 1]), np.array([2, 2]))
    with pytest.raises(InternalError, match="overlaps"):
        dma.plan(src, dst, overlap)


def test_the_driver_gets_the_plans_arrays_byte_for_byte() -> None:
    """Every argument as the driver reads it: the three arrays are the plan's
    own bytes, one attribute set from copy 0 on (24 bytes, cuda.h's layout),
    the stream handle as given."""
    rng = np.random.default_rng(3)
    src, dst = _buffer(128 * PAGE, rng), _buffer(128 * PAGE)
    t = _pages(src, dst, rng.permutation(128)[:50], rng.permutation(128)[:50])
    p = dma.plan(src, dst, t)
    lib = FakeLib()
    dma.bind(lib)(p, dma.attributes("load", 3), 0xDEAD000)
    (call,) = lib.calls
    assert call["dsts"].tobytes() == p.dsts.tobytes()
    assert call["srcs"].tobytes() == p.srcs.tobytes()
    assert call["sizes"].tobytes() == p.sizes.tobytes()
    assert call["idxs"].tolist() == [0] and call["stream"] == 0xDEAD000
    order, src_type, src_id, dst_type, dst_id, flags = np.frombuffer(
        call["attrs"], np.int32
    )
    assert order == dma.SRC_ACCESS_ORDER_STREAM
    assert (src_type, dst_type, dst_id) == (dma.LOCATION_HOST, dma.LOCATION_DEVICE, 3)
    assert flags == dma.FLAG_PREFER_OVERLAP_WITH_COMPUTE
    save = np.frombuffer(bytes(dma.attributes("save", 1)), np.int32)
    assert save[1:5].tolist() == [dma.LOCATION_DEVICE, 1, dma.LOCATION_HOST, 0]
    assert src_id == 0


def test_long_plans_go_in_several_calls() -> None:
    src, dst = _buffer(64 * PAGE), _buffer(64 * PAGE)
    pages = np.arange(0, 14, 2)  # 7 pages, none adjacent
    p = dma.plan(src, dst, _pages(src, dst, pages, pages + 1))
    lib = FakeLib()
    dma.bind(lib, max_batch=3)(p, dma.attributes("save", 0), 1)
    assert [len(c["sizes"]) for c in lib.calls] == [3, 3, 1]
    for field in ("dsts", "srcs", "sizes"):
        got = np.concatenate([c[field] for c in lib.calls])
        assert got.tobytes() == getattr(p, field).tobytes()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FakeLib(status=1), r"cuMemcpyBatchAsync\(2 copies from 0\)"),
        (lambda: FakeLib(legacy=True, status=1, fail_at=1), "copy 1"),
    ],
)
def test_a_failed_call_names_the_call(make: Callable[[], FakeLib], match: str) -> None:
    src, dst = _buffer(8 * PAGE), _buffer(8 * PAGE)
    p = dma.plan(src, dst, _pages(src, dst, np.array([0, 5]), np.array([1, 3])))
    with pytest.raises(CudaError, match=match):
        dma.bind(make())(p, dma.attributes("save", 0), 1)


def test_the_12_8_call_passes_a_fail_index() -> None:
    src, dst = _buffer(8 * PAGE), _buffer(8 * PAGE)
    p = dma.plan(src, dst, _pages(src, dst, np.array([0]), np.array([1])))
    lib = FakeLib(legacy=True)
    dma.bind(lib)(p, dma.attributes("save", 0), 77)
    (call,) = lib.calls
    assert call["sizes"].tolist() == [PAGE] and call["stream"] == 77


def test_a_driver_without_the_call_is_refused_clearly() -> None:
    with pytest.raises(CudaError, match="12.8"):
        dma.bind(object())


def test_attributes_match_cuda_h() -> None:
    assert ctypes.sizeof(dma.MemcpyAttributes) == 24
    assert dma.MemcpyAttributes.flags.offset == 20


@pytest.mark.parametrize("pool_is", ["dst", "src"])
def test_plan_cuts_copies_at_the_pools_registration_edges(pool_is: str) -> None:
    """The pool is pinned in chunks (cudaHostRegister per 8 GiB): no copy may
    span two of them, whether a merged run crosses the edge or one slot does
    (a slab size that does not divide the chunk). Here chunks of 3 pages and
    half-page slots off the page grid; the bytes moved are the same."""
    rng = np.random.default_rng(3)
    pool, engine = _buffer(64 * PAGE, rng), _buffer(64 * PAGE, rng)
    chunk = 3 * PAGE
    ids = np.concatenate([np.arange(2, 12), [20, 30, 31]])
    half = PAGE // 2
    offsets = ids.astype(np.uint64) * np.uint64(PAGE) + np.uint64(half)
    pool_side = np.uint64(pool.address) + offsets  # every slot straddles or not
    engine_side = np.uint64(engine.address) + np.arange(
        len(ids), dtype=np.uint64
    ) * np.uint64(PAGE)
    sizes = np.full(len(ids), PAGE, np.uint64)
    if pool_is == "dst":
        src, dst, t = engine, pool, Transfers(engine_side, pool_side, sizes)
    else:
        src, dst, t = pool, engine, Transfers(pool_side, engine_side, sizes)
    p = dma.plan(src, dst, t, (pool.address, chunk))
    host = p.dsts if pool_is == "dst" else p.srcs
    first = (host - np.uint64(pool.address)) // np.uint64(chunk)
    last = (host + p.sizes - np.uint64(1) - np.uint64(pool.address)) // np.uint64(chunk)
    assert (first == last).all()  # no copy spans two chunks
    assert int(p.sizes.sum()) == t.total_bytes and len(p) > 3
    want = _buffer(64 * PAGE)
    want.data[:] = dst.data
    moved = np.uint64((want.address - dst.address) % (1 << 64))  # wraps, as uint64
    cpu.copy_descriptors(src, want, Transfers(t.src, t.dst + moved, sizes), stream=None)
    lib = FakeLib()
    lib.execute = True
    dma.bind(lib)(p, dma.attributes("save", 0), 0x5150)
    assert bytes(dst.data) == bytes(want.data)
    unchunked = dma.plan(src, dst, t)
    assert len(unchunked) < len(p)  # the runs merged across the edges before
