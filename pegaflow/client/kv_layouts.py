"""Describe an engine's KV tensors as memory regions + per-layer layouts.

Works on torch tensors and numpy arrays alike, from their storage and strides, so
the same code covers vLLM 0.33 (every layer a view into one int8 buffer, pages in
LBNHC/LBHNC/BLNHC... order) and per-layer K/V-first tensors [2, blocks, ...].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pegaflow.common.geometry import LayerLayout, Segment


@dataclass(frozen=True, slots=True)
class KVMemory:
    regions: tuple[tuple[int, int], ...]  # (address, size) of each allocation
    layers: tuple[LayerLayout, ...]


def _storage(t: object) -> tuple[int, int, int]:
    """(data address, storage address, storage bytes) of a tensor or array."""
    if isinstance(t, np.ndarray):
        root = t
        while isinstance(root.base, np.ndarray):
            root = root.base
        return t.ctypes.data, root.ctypes.data, root.nbytes
    storage = t.untyped_storage()  # torch
    return t.data_ptr(), storage.data_ptr(), storage.nbytes()


def _shape_strides(t: object) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Shape, strides in bytes, item size."""
    if isinstance(t, np.ndarray):
        return t.shape, t.strides, t.itemsize
    item = t.element_size()
    return tuple(t.shape), tuple(s * item for s in t.stride()), item


def _span(shape: Sequence[int], strides: Sequence[int], item: int) -> tuple[int, int]:
    """(bytes covered, element bytes) of a sub-tensor; contiguous iff equal."""
    if any(n == 0 for n in shape):
        return 0, 0
    covered = sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True)) + item
    return covered, int(np.prod(shape)) * item


def describe(tensors: Sequence[object], kv_first: bool = False) -> KVMemory:
    """Regions and layer layouts for per-layer KV tensors (in layer order).

    kv_first: tensors are [2, blocks, ...] (K and V as two segments per page);
    otherwise the block dimension is first and a block's page must be contiguous.
    """
    regions: dict[int, tuple[int, int]] = {}
    layers: list[LayerLayout] = []
    for i, t in enumerate(tensors):
        data, base, nbytes = _storage(t)
        index = regions.setdefault(base, (len(regions), nbytes))[0]
        shape, strides, item = _shape_strides(t)
        if kv_first:
            if shape[0] != 2:
                raise ValueError(f"tensors[{i}]: K/V-first needs dim 0 == 2, {shape}")
            block_dim, seg_offsets = 1, (0, strides[0])
        else:
            block_dim, seg_offsets = 0, (0,)
        inner = [d for d in range(len(shape)) if d > block_dim]
        covered, size = _span(
            [shape[d] for d in inner], [strides[d] for d in inner], item
        )
        if covered != size:
            raise ValueError(f"tensors[{i}]: a block's page is not contiguous")
        layers.append(
            LayerLayout(
                region_index=index,
                offset=data - base,
                num_blocks=shape[block_dim],
                block_stride=strides[block_dim],
                segments=tuple(Segment(off, size) for off in seg_offsets),
            )
        )
    ordered = sorted(regions.items(), key=lambda kv: kv[1][0])
    return KVMemory(tuple((base, n) for base, (_, n) in ordered), tuple(layers))


def vllm_layer_views(
    buffer: object,
    num_layers: int,
    num_blocks: int,
    page_shape: tuple[int, ...],
    block_first: bool = False,
) -> list[object]:
    """Per-layer [blocks, *page_shape] views into one flat buffer, as vLLM 0.33
    lays them out: layer-major (LB..., default) or block-first (BL...)."""
    page = int(np.prod(page_shape))
    if block_first:
        whole = buffer.reshape(num_blocks, num_layers, *page_shape)
        return [whole[:, layer] for layer in range(num_layers)]
    whole = buffer.reshape(num_layers, num_blocks, *page_shape)
    assert whole.shape[-len(page_shape) :] == tuple(page_shape) and page > 0
    return [whole[layer] for layer in range(num_layers)]
