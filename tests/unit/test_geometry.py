"""Descriptor tables from KV geometry, against a numpy reference copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pegaflow.cache.registration_checks import validate_layers
from pegaflow.client.kv_layouts import describe, vllm_layer_views
from pegaflow.common.errors import InvalidRequest
from pegaflow.common.geometry import (
    SMALL_IDS,
    KVGeometry,
    LayerLayout,
    Segment,
    check_block_ids,
    first_overlap,
)


def _apply(t, src_arr: np.ndarray, dst_arr: np.ndarray) -> None:
    """Run a descriptor table with numpy, addresses relative to the two arrays."""
    s0, d0 = src_arr.ctypes.data, dst_arr.ctypes.data
    for s, d, n in zip(t.src.tolist(), t.dst.tolist(), t.nbytes.tolist(), strict=True):
        dst_arr[d - d0 : d - d0 + n] = src_arr[s - s0 : s - s0 + n]


@pytest.mark.parametrize("block_first", [False, True])
def test_vllm_views_gather_matches_reference(block_first: bool) -> None:
    layers, blocks, page = 3, 10, 256
    buf = np.random.default_rng(1).integers(0, 256, layers * blocks * page, np.uint8)
    views = vllm_layer_views(buf, layers, blocks, (page,), block_first)
    mem = describe(views)
    assert mem.regions == ((buf.ctypes.data, buf.nbytes),)
    geo = KVGeometry(mem.layers, [r[0] for r in mem.regions])
    assert geo.slot_bytes == layers * page
    ids = np.array([7, 2, 2, 9])
    slots = np.zeros(len(ids) * geo.slot_bytes, np.uint8)
    addrs = slots.ctypes.data + np.arange(len(ids), dtype=np.uint64) * geo.slot_bytes
    _apply(geo.engine_to_slots(ids, addrs, np.arange(layers)), buf, slots)
    expect = np.concatenate([np.concatenate([v[b] for v in views]) for b in ids])
    assert np.array_equal(slots, expect)


def test_torch_kv_first_two_segments() -> None:
    layers = [
        torch.randint(0, 100, (2, 5, 16, 2, 8), dtype=torch.int16) for _ in range(2)
    ]
    mem = describe(layers, kv_first=True)
    assert len(mem.regions) == 2
    half = 16 * 2 * 8 * 2
    assert mem.layers[0].segments == (Segment(0, half), Segment(5 * half, half))
    assert mem.layers[0].block_stride == half
    geo = KVGeometry(mem.layers, [r[0] for r in mem.regions])
    assert geo.slot_bytes == 2 * 2 * half
    # slot order: layer 0 K, layer 0 V, layer 1 K, layer 1 V
    slot = np.zeros(geo.slot_bytes, np.uint8)
    t = geo.engine_to_slots(
        np.array([3]), np.array([slot.ctypes.data], np.uint64), np.arange(2)
    )
    src = [
        bytes(x[i, 3].contiguous().view(torch.uint8).numpy())
        for x in layers
        for i in (0, 1)
    ]
    import ctypes

    for s, d, n in zip(t.src.tolist(), t.dst.tolist(), t.nbytes.tolist(), strict=True):
        ctypes.memmove(d, s, n)
    assert bytes(slot) == b"".join(src)


def test_torch_permuted_lbnhc_view_is_one_page() -> None:
    buf = torch.zeros(2 * 4 * 16 * 8 * 32, dtype=torch.int8)
    phys = buf.view(2, 4, 16, 8, 32)  # L, B, N, H, C
    views = [phys[i].permute(0, 2, 1, 3) for i in range(2)]  # [B, H, N, C]
    mem = describe(views)
    assert [lay.segments for lay in mem.layers] == [(Segment(0, 4096),)] * 2
    assert mem.layers[1].offset == 4 * 4096


def test_noncontiguous_page_rejected() -> None:
    t = torch.zeros(4, 8, 8)[:, :, :4]
    with pytest.raises(ValueError, match="not contiguous"):
        describe([t])


def test_validate_layers_bounds() -> None:
    # Pages of 1000 B: segments under 512 B on average are refused (limits).
    good = LayerLayout(0, 0, 4, 1000, (Segment(0, 1000),))
    validate_layers((good,), [4000])
    with pytest.raises(InvalidRequest, match=r"layers\[0\].*reach byte 5000"):
        validate_layers((LayerLayout(0, 1000, 4, 1000, (Segment(0, 1000),)),), [4000])
    with pytest.raises(InvalidRequest, match="region_index"):
        validate_layers((LayerLayout(1, 0, 4, 1000, (Segment(0, 1000),)),), [4000])
    with pytest.raises(InvalidRequest, match="num_blocks"):
        validate_layers((good, LayerLayout(0, 0, 3, 1000, (Segment(0, 1000),))), [4000])
    with pytest.raises(InvalidRequest, match="layers"):
        validate_layers((), [4000])


def test_check_block_ids() -> None:
    check_block_ids(np.array([0, 3]), 4, "block_ids")
    with pytest.raises(InvalidRequest, match="block_ids: block id 4"):
        check_block_ids(np.array([0, 4]), 4, "block_ids")
    with pytest.raises(InvalidRequest, match="block id -1"):
        check_block_ids(np.array([-1]), 4, "block_ids")


@pytest.mark.parametrize("n", [1, SMALL_IDS, SMALL_IDS + 1, 300])
def test_check_block_ids_small_and_large_requests_alike(n: int) -> None:
    """Few ids are checked as Python ints, many with numpy: the same verdict
    and the same first bad id, whatever the dtype."""
    for dtype in (np.int64, np.uint64, np.int32):
        ids = np.arange(n, dtype=dtype)
        check_block_ids(ids, n, "block_ids")
        with pytest.raises(InvalidRequest, match=f"block id {n - 1} outside"):
            check_block_ids(ids, n - 1, "block_ids")
    huge = np.full(n, np.iinfo(np.uint64).max, np.uint64)
    with pytest.raises(InvalidRequest, match="block id 18446744073709551615"):
        check_block_ids(huge, 10, "block_ids")
    negative = np.arange(n, dtype=np.int64) - 1
    with pytest.raises(InvalidRequest, match="block id -1 outside"):
        check_block_ids(negative, n + 1, "block_ids")


def test_page_skew_follows_engine_alignment() -> None:
    layers = tuple(
        LayerLayout(0, i * 8192, 4, 4096, (Segment(0, 4096),)) for i in range(2)
    )
    assert KVGeometry(layers, [0x10000 + 64]).page_skew == 64
    assert KVGeometry(layers, [0x10000]).page_skew == 0
    odd = (LayerLayout(0, 0, 4, 1000, (Segment(0, 1000),)),)
    assert KVGeometry(odd, [0x10000 + 64]).page_skew == 0  # no common residue


def test_layer_rows_match_isin() -> None:
    """engine_to_slots picks rows by a layer mask: the same rows, in the same
    order, as np.isin, whatever the ids (ids outside the layers pick none)."""
    segs = (Segment(0, 1024), Segment(4096, 512))
    layers = tuple(LayerLayout(0, i * 65536, 8, 8192, segs) for i in range(5))
    g = KVGeometry(layers, [0x100000])
    slots = np.array([0x900000, 0x800000], np.uint64)
    cases = ([], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [0, 1, 2, 3, 3], [3, 1], [4],
             [2, 9], [-1, 0], [1, 1])  # fmt: skip
    for ids in cases:  # every layer in order: the rows-as-they-are path
        layer_ids = np.array(ids, np.int64)
        got = g.engine_to_slots(np.array([3, 5]), slots, layer_ids)
        rows = np.flatnonzero(np.isin(g.layer_rows, layer_ids))
        want = g._transfers(np.array([3, 5]), slots, rows)
        for field in ("src", "dst", "nbytes"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == np.uint64 and a.tolist() == b.tolist()
    back = g.slots_to_engine(slots, np.array([3, 5]))
    full = g.engine_to_slots(np.array([3, 5]), slots, np.arange(5))
    assert back.src.tolist() == full.dst.tolist() and len(back) == 20


def test_a_one_block_table_is_the_first_block_of_a_longer_one() -> None:
    """The 1-block tables (built 1-D) hold the rows a 2-block table holds
    for that block, in arrays of their own."""
    segs = (Segment(0, 1024), Segment(4096, 512))
    layers = tuple(LayerLayout(0, i * 65536, 8, 8192, segs) for i in range(5))
    g = KVGeometry(layers, [0x100000])
    slots = np.array([0x900000, 0x800000], np.uint64)
    for ids in (np.array([6, 2]), np.array([6, 2], np.int32)):
        pairs = (
            (g.slots_to_engine(slots[:1], ids[:1]), g.slots_to_engine(slots, ids)),
            (
                g.engine_to_slots(ids[:1], slots[:1], np.arange(5)),
                g.engine_to_slots(ids, slots, np.arange(5)),
            ),
        )
        for one, two in pairs:
            for field in ("src", "dst", "nbytes"):
                a, b = getattr(one, field), getattr(two, field)
                assert a.dtype == np.uint64 and a.tolist() == b.tolist()[: len(a)]
            assert len(one) == 10 and one.total_bytes == 5 * 1536
            assert not np.shares_memory(one.nbytes, g.seg_bytes)


def _overlaps_by_brute_force(layers: tuple[LayerLayout, ...]) -> bool:
    pages = sorted(
        (lay.region_index, lay.offset + b * lay.block_stride + seg.offset, seg.size)
        for lay in layers
        for b in range(lay.num_blocks)
        for seg in lay.segments
    )
    return any(
        r1 == r2 and s1 + w1 > s2
        for (r1, s1, w1), (r2, s2, _) in zip(pages, pages[1:], strict=False)
    )


def test_first_overlap_agrees_with_every_page_compared() -> None:
    """Random same-stride layouts of 1-4 layers x 1-3 segments: the per-pair
    test says overlap exactly when some two pages share a byte."""
    rng = np.random.default_rng(5)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        blocks, stride = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        layers = tuple(
            LayerLayout(
                int(rng.integers(0, 2)),
                int(rng.integers(0, 120)),
                blocks,
                stride,
                tuple(
                    Segment(int(rng.integers(0, 30)), int(rng.integers(1, 12)))
                    for _ in range(int(rng.integers(1, 4)))
                ),
            )
            for _ in range(int(rng.integers(1, 5)))
        )
        want = _overlaps_by_brute_force(layers)
        assert (first_overlap(layers) is not None) == want, layers
        seen[want] += 1
    assert min(seen.values()) > 300  # both answers well represented


def test_real_layouts_have_no_overlap() -> None:
    """vLLM's layer-major (LBNHC), block-major and K/V-first pages."""
    page = 4096
    lbnhc = tuple(LayerLayout(0, i * 64 * page, 64, page, (Segment(0, page),))
                  for i in range(32))  # fmt: skip
    block_major = tuple(LayerLayout(0, i * page, 64, 32 * page, (Segment(0, page),))
                        for i in range(32))  # fmt: skip
    kv_first = tuple(
        LayerLayout(
            0, i * 128 * page, 64, page, (Segment(0, page), Segment(64 * page, page))
        )
        for i in range(32)
    )
    for layers in (lbnhc, block_major, kv_first):
        assert first_overlap(layers) is None
