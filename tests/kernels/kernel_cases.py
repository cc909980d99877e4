"""Scenarios shared by the CPU, simulator and GPU kernel tests (numpy only).

Each case is a source buffer of random bytes, a destination poisoned with 0xAB
and a descriptor table of offsets; the reference applies the descriptors with
plain numpy slices, so every byte of the destination — copied or not — is
checked against it. Shapes are tiny: the simulator runs a Python thread per
CUDA thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import numpy as np

from pegaflow import kernels
from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment, Transfers

POISON = 0xAB
MLA_DIM = 576  # DeepSeek MLA latent + rope, bf16


@dataclass(frozen=True)
class Case:
    name: str
    src: np.ndarray  # uint8, random
    dst_bytes: int
    table: np.ndarray  # uint64 [n, 3]: src offset, dst offset, nbytes
    op: str = "gather"  # gather | scatter
    width: int = 16
    max_blocks: int | None = None


def lbnhc(layers: int, blocks: int, page: int, skew: int = 0) -> tuple:
    """vLLM 0.33 default: each layer's blocks back to back, a page per block."""
    return tuple(
        LayerLayout(0, skew + i * blocks * page, blocks, page, (Segment(0, page),))
        for i in range(layers)
    )


def blnhc(layers: int, blocks: int, page: int) -> tuple:
    """Block-first: all layers of a block are contiguous."""
    return tuple(
        LayerLayout(0, i * page, blocks, layers * page, (Segment(0, page),))
        for i in range(layers)
    )


def kv_first(layers: int, blocks: int, half: int) -> tuple:
    """Older vLLM [2, blocks, ...] per layer: K and V pages far apart."""
    segs = (Segment(0, half), Segment(blocks * half, half))
    return tuple(
        LayerLayout(0, i * 2 * blocks * half, blocks, half, segs) for i in range(layers)
    )


def from_geometry(
    name: str,
    layers: tuple,
    ids: list[int],
    slots: list[int],
    seed: int,
    pool_skew: int = 0,
    op: str = "gather",
) -> Case:
    """Engine blocks `ids` <-> pool slots `slots` (a scatter reverses the table)."""
    geo = KVGeometry(layers, [0])
    engine_bytes = max(layer.span_end() for layer in layers) + 16
    pool_bytes = pool_skew + (max(slots, default=0) + 1) * geo.slot_bytes + 16
    t = geo.engine_to_slots(
        np.array(ids, np.int64),
        pool_skew + np.array(slots, np.int64) * geo.slot_bytes,
        np.arange(len(layers)),
    )
    table = np.stack([t.src, t.dst, t.nbytes], axis=1).astype(np.uint64)
    sizes = (engine_bytes, pool_bytes)
    if op == "scatter":
        table = table[:, [1, 0, 2]]
        sizes = sizes[::-1]
    src = np.random.default_rng(seed).integers(0, 256, sizes[0], dtype=np.uint8)
    return Case(name, src, sizes[1], table, op)


def raw(name: str, rows: list[tuple[int, int, int]], seed: int, **kw: Any) -> Case:
    table = np.array(rows, np.uint64).reshape(-1, 3)
    end = lambda c: int((table[:, c] + table[:, 2]).max(initial=0)) + 32  # noqa: E731
    src = np.random.default_rng(seed).integers(0, 256, end(0), dtype=np.uint8)
    return Case(name, src, end(1), table, **kw)


def fuzz(name: str, seed: int, count: int = 24) -> Case:
    """Random sizes and alignments, disjoint destinations in random order."""
    rng = np.random.default_rng(seed)
    nbytes = rng.integers(0, 300, count)
    gaps = rng.integers(0, 40, count)
    dst = np.cumsum(gaps + nbytes) - nbytes
    rows = np.stack([rng.integers(0, 4096, count), dst, nbytes], axis=1)
    return raw(name, [tuple(r) for r in rng.permutation(rows).tolist()], seed)


def all_cases() -> list[Case]:
    cases = [
        from_geometry("lbnhc", lbnhc(3, 5, 96), [3, 0, 4], [2, 0, 1], 1),
        from_geometry("blnhc_8b", blnhc(3, 4, 72), [1, 3], [1, 0], 2),
        from_geometry("kv_first", kv_first(2, 4, 48), [2, 1, 3], [0, 2, 1], 3),
        from_geometry("mla", lbnhc(2, 3, MLA_DIM * 2 * 2), [2, 0], [1, 0], 4),
        from_geometry("odd_pages", lbnhc(2, 4, 37, skew=3), [1, 2], [0, 1], 5),
        from_geometry("skew4", lbnhc(2, 4, 100, skew=4), [3, 1], [1, 0], 6, 4),
        from_geometry("duplicate_ids", lbnhc(2, 4, 64), [1, 1, 2], [0, 1, 2], 7),
        from_geometry("empty_ids", lbnhc(2, 4, 64), [], [], 8),
        from_geometry(
            "scatter_lbnhc", lbnhc(3, 5, 96), [4, 2], [0, 1], 9, op="scatter"
        ),
        from_geometry(
            "scatter_kv_first", kv_first(2, 4, 48), [0, 3], [1, 0], 10, op="scatter"
        ),
        raw(
            "mixed_alignment",
            [(8, 24, 200), (4, 300, 77), (1, 512, 40), (640, 704, 3), (800, 1000, 0)],
            11,
        ),
    ]
    cases += [fuzz(f"fuzz{i}", 100 + i) for i in range(3)]
    base = cases[0]
    cases += [
        replace(base, name="width8", width=8),
        replace(base, name="width1", width=1),
        replace(base, name="one_block", max_blocks=1),
    ]
    return cases


def reference(case: Case) -> np.ndarray:
    out = np.full(case.dst_bytes, POISON, np.uint8)
    for s, d, n in case.table.tolist():
        out[d : d + n] = case.src[s : s + n]
    return out


Read = Callable[[], np.ndarray]
Alloc = Callable[[np.ndarray], tuple[Any, Read]]


def host_alloc(k: ModuleType) -> Alloc:
    """(Buffer, reader) over 16-byte aligned host memory holding `init`."""

    def alloc(init: np.ndarray) -> tuple[Any, Read]:
        host = kernels.plan.aligned_empty(len(init))
        host[:] = init
        return k.wrap_array(host), host.copy

    return alloc


def prepare_case(
    k: ModuleType, case: Case, engine: Alloc, pool: Alloc, stream: Any = None
) -> tuple[Callable[[], None], Read]:
    """Buffers for `case` on backend `k`: (the copy, reader of the destination).

    `engine` / `pool` allocate the device-side and host-side buffers; a gather
    reads the engine and writes the pool, a scatter the reverse.
    """
    gathers = case.op == "gather"
    dst_init = np.full(case.dst_bytes, POISON, np.uint8)
    src_buf, _ = (engine if gathers else pool)(case.src)
    dst_buf, read = (pool if gathers else engine)(dst_init)
    base = np.array([src_buf.address, dst_buf.address, 0], np.uint64)
    abs_table = case.table + base
    t = Transfers(*(abs_table[:, c].copy() for c in range(3)))
    stream = stream if stream is not None else k.stream()

    def copy() -> None:
        kw = {"stream": stream, "max_blocks": case.max_blocks, "width": case.width}
        getattr(k, case.op)(src_buf, dst_buf, t, **kw)
        k.synchronize(stream)

    return copy, read


def run_case(
    k: ModuleType, case: Case, engine: Alloc, pool: Alloc, stream: Any = None
) -> np.ndarray:
    """Run `case` through backend `k` (on `stream`, or a new one) and return
    the destination's bytes."""
    copy, read = prepare_case(k, case, engine, pool, stream)
    copy()
    return read()


def check(case: Case, got: np.ndarray) -> None:
    want = reference(case)
    bad = np.flatnonzero(got != want)
    assert not bad.size, (
        f"{case.name}: {bad.size} bytes differ, first at {bad[0]} "
        f"(got {got[bad[0]]:#x}, want {want[bad[0]]:#x})"
    )
