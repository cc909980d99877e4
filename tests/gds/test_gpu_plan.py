"""The SSD → GPU direct load planner (gds.gpu_plan) against a plain reference:
random engine layouts, records scattered over files, byte maps on both sides."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment
from pegaflow.gds.format import HEADER_BYTES, align_up
from pegaflow.gds.gpu_plan import RecordSpans, plan_reads

BASE = 1 << 20  # the "device" address of the engine's region


def layout(rng: np.random.Generator, kind: str, blocks: int) -> list[LayerLayout]:
    """kind: block-major (a block's layers back to back), layer-major (vLLM
    0.33's LBNHC) or kv_first (two segments per page, far apart)."""
    layers = int(rng.integers(1, 6))
    page = int(rng.choice([64, 256, 4096]))
    if kind == "block_major":
        stride = layers * page
        return [
            LayerLayout(0, i * page, blocks, stride, (Segment(0, page),))
            for i in range(layers)
        ]
    if kind == "layer_major":
        return [
            LayerLayout(0, i * blocks * page, blocks, page, (Segment(0, page),))
            for i in range(layers)
        ]
    half = page // 2  # K of every block, then V of every block, per layer
    span = 2 * blocks * half
    segs = (Segment(0, half), Segment(blocks * half, half))
    return [LayerLayout(0, i * span, blocks, half, segs) for i in range(layers)]


def records(
    rng: np.random.Generator, n: int, slot: int, files: int
) -> tuple[RecordSpans, list[np.ndarray]]:
    """n records placed at random, some back to back, over `files` files of
    random bytes; returns their spans and the files."""
    length = HEADER_BYTES + align_up(slot)
    per_file = n + 4
    where = rng.permutation(files * per_file)[:n]
    nxt = where[0] + 1  # a back-to-back pair, as a writer's batch lays them down
    if n > 2 and nxt % per_file and nxt not in where:
        where[1] = nxt
    file = where // per_file
    offset = (where % per_file) * length + 4096
    data = [
        rng.integers(0, 256, 4096 + per_file * length, dtype=np.uint8)
        for _ in range(files)
    ]
    spans = RecordSpans(
        file.astype(np.int64),
        offset.astype(np.uint64),
        np.full(n, length, np.uint64),
        np.full(n, slot, np.uint64),
    )
    return spans, data


def apply(plan, disk: list[np.ndarray], size: int) -> np.ndarray:
    dev = np.zeros(size, np.uint8)
    for f, o, d, n in zip(
        plan.file.tolist(),
        plan.file_offset.tolist(),
        plan.device.tolist(),
        plan.nbytes.tolist(),
        strict=True,
    ):
        assert not dev[d - BASE : d - BASE + n].any(), "two reads overlap"
        dev[d - BASE : d - BASE + n] = disk[f][o : o + n]
    return dev


def reference(geo: KVGeometry, spans, ids, disk, size) -> np.ndarray:
    """Per record, per (layer, segment) row: what must land where."""
    dev = np.zeros(size, np.uint8)
    for r, b in enumerate(ids.tolist()):
        f, off = int(spans.file[r]), int(spans.offset[r]) + HEADER_BYTES
        for row in range(len(geo.seg_bytes)):
            d = int(geo.engine_offset[row]) + b * int(geo.block_stride[row]) - BASE
            s, n = int(geo.slot_offset[row]), int(geo.seg_bytes[row])
            dev[d : d + n] = disk[f][off + s : off + s + n]
    return dev


@pytest.mark.parametrize("kind", ["block_major", "layer_major", "kv_first"])
@pytest.mark.parametrize("seed", range(6))
def test_plan_lands_every_byte_where_the_reference_does(kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    blocks = int(rng.integers(4, 40))
    layers = layout(rng, kind, blocks)
    geo = KVGeometry(tuple(layers), [BASE])
    size = max(x.span_end() for x in layers)
    n = int(rng.integers(1, blocks + 1))
    spans, disk = records(rng, n, geo.slot_bytes, int(rng.integers(1, 4)))
    ids = rng.permutation(blocks)[:n]
    plan = plan_reads(spans, ids, geo, [(BASE, size)])
    assert plan.planned.all()
    got = apply(plan, disk, size)
    np.testing.assert_array_equal(got, reference(geo, spans, ids, disk, size))
    assert plan.total_bytes == n * geo.slot_bytes
    # Reads sorted by (file, offset), never crossing a file.
    key = plan.file.astype(np.uint64) * np.uint64(1 << 40) + plan.file_offset
    assert (np.diff(key.astype(np.int64)) > 0).all()
    # Fetching the back ranges back to back gives each record's payload.
    host = np.concatenate(
        [
            got[d - BASE : d - BASE + m]
            for d, m in zip(plan.back, plan.back_bytes, strict=True)
        ]
    )
    want = np.concatenate(
        [
            disk[int(spans.file[r])][
                int(spans.offset[r]) + HEADER_BYTES : int(spans.offset[r])
                + HEADER_BYTES
                + geo.slot_bytes
            ]
            for r in range(n)
        ]
    )
    np.testing.assert_array_equal(host, want)


def test_block_major_back_to_back_records_into_consecutive_blocks_merge() -> None:
    """A block's pages back to back on both sides: one read per record, and
    none across the header page between two records."""
    layers = [
        LayerLayout(0, i * 4096, 8, 4 * 4096, (Segment(0, 4096),)) for i in range(4)
    ]
    geo = KVGeometry(tuple(layers), [BASE])
    length = HEADER_BYTES + geo.slot_bytes
    spans = RecordSpans(
        np.zeros(3, np.int64),
        np.array([4096, 4096 + length, 4096 + 2 * length], np.uint64),
        np.full(3, length, np.uint64),
        np.full(3, geo.slot_bytes, np.uint64),
    )
    plan = plan_reads(spans, np.array([2, 3, 4]), geo, [(BASE, 8 * 4 * 4096)])
    assert len(plan) == 3
    assert plan.nbytes.tolist() == [geo.slot_bytes] * 3
    assert len(plan.back) == 1  # the three blocks are contiguous on the device


def test_layer_major_reads_one_page_each() -> None:
    layers = [
        LayerLayout(0, i * 8 * 4096, 8, 4096, (Segment(0, 4096),)) for i in range(3)
    ]
    geo = KVGeometry(tuple(layers), [BASE])
    length = HEADER_BYTES + geo.slot_bytes
    spans = RecordSpans(
        np.zeros(2, np.int64),
        np.array([4096, 4096 + length], np.uint64),
        np.full(2, length, np.uint64),
        np.full(2, geo.slot_bytes, np.uint64),
    )
    plan = plan_reads(spans, np.array([0, 1]), geo, [(BASE, 3 * 8 * 4096)])
    assert len(plan) == 6


def _one_layer(blocks: int = 4) -> KVGeometry:
    return KVGeometry((LayerLayout(0, 0, blocks, 4096, (Segment(0, 4096),)),), [BASE])


def _spans(n: int, payload: int = 4096) -> RecordSpans:
    length = HEADER_BYTES + align_up(payload)
    return RecordSpans(
        np.zeros(n, np.int64),
        np.arange(n, dtype=np.uint64) * np.uint64(length) + np.uint64(4096),
        np.full(n, length, np.uint64),
        np.full(n, payload, np.uint64),
    )


def test_destination_outside_the_registered_memory_is_an_internal_error() -> None:
    geo = _one_layer()
    with pytest.raises(InternalError, match="block 3's page"):
        plan_reads(_spans(2), np.array([0, 3]), geo, [(BASE, 3 * 4096)])
    with pytest.raises(InternalError, match="leaves the worker's registered"):
        plan_reads(_spans(1), np.array([0]), geo, [(BASE + 4096, 4 * 4096)])
    with pytest.raises(InternalError, match="no GPU regions"):
        plan_reads(_spans(1), np.array([0]), geo, [])


def test_two_regions_each_destination_inside_one() -> None:
    layers = (
        LayerLayout(0, 0, 4, 4096, (Segment(0, 4096),)),
        LayerLayout(1, 0, 4, 4096, (Segment(0, 4096),)),
    )
    far = BASE + (1 << 30)
    geo = KVGeometry(layers, [BASE, far])
    spans = _spans(2, geo.slot_bytes)
    plan = plan_reads(spans, np.array([1, 2]), geo, [(far, 4 * 4096), (BASE, 4 * 4096)])
    assert plan.total_bytes == 2 * geo.slot_bytes
    with pytest.raises(InternalError, match="block 2's page"):
        plan_reads(spans, np.array([1, 2]), geo, [(far, 4 * 4096), (BASE, 2 * 4096)])


def test_bad_block_ids_and_short_records_are_internal_errors() -> None:
    geo = _one_layer()
    regions = [(BASE, 4 * 4096)]
    with pytest.raises(InternalError, match="block id 4 outside"):
        plan_reads(_spans(1), np.array([4]), geo, regions)
    with pytest.raises(InternalError, match="two records into one engine block"):
        plan_reads(_spans(2), np.array([1, 1]), geo, regions)
    with pytest.raises(InternalError, match="2 records, 1 blocks"):
        plan_reads(_spans(2), np.array([1]), geo, regions)
    short = _spans(1)
    short = RecordSpans(short.file, short.offset, short.length - 4096, short.payload)
    with pytest.raises(InternalError, match="shorter than its payload"):
        plan_reads(short, np.array([0]), geo, regions)


def test_records_of_other_geometry_or_several_shards_are_left_to_l1() -> None:
    geo = _one_layer()
    spans = _spans(3)
    spans = RecordSpans(
        spans.file,
        spans.offset,
        spans.length + 4096,
        np.array([4096, 2 * 4096, 4096], np.uint64),  # the middle one: TP 2
    )
    plan = plan_reads(spans, np.array([0, 1, 2]), geo, [(BASE, 4 * 4096)])
    assert plan.planned.tolist() == [True, False, True]
    assert plan.total_bytes == 2 * 4096
    empty = plan_reads(_spans(0), np.array([], np.int64), geo, [(BASE, 4 * 4096)])
    assert len(empty) == 0 and len(empty.back) == 0
