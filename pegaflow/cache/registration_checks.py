"""What a registration may describe: the server's checks of a RegisterSpec
before anything is opened (who may register which memory is
pegaflow.common.identity; whose instance id it is, pegaflow.cache.instances)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pegaflow.common import request_limits as limits
from pegaflow.common.errors import InvalidRequest
from pegaflow.common.geometry import (
    MAX_LAYERS,
    MAX_SEGMENTS_PER_LAYER,
    LayerLayout,
    first_overlap,
)
from pegaflow.common.keys import IPC_HANDLE_BYTES, TOKEN_BYTES, UUID_BYTES
from pegaflow.copiers.copier import CudaExport, RegionKind

MAX_ID_LEN = 256
MAX_TP = 1024
MAX_REGIONS = 64
MAX_EVENTS = 64
_DEVICE_RE = re.compile(r"^(cpu|cuda:\d{1,3})$")


@dataclass(frozen=True, slots=True)
class RegisterSpec:
    instance_id: str
    namespace: str
    tp_rank: int
    tp_size: int
    world_size: int
    device: str
    region_kind: RegionKind
    pid: int
    regions: tuple[tuple[int, int], ...]  # (address or offset, size)
    layers: tuple[LayerLayout, ...]
    cuda: CudaExport | None = None  # set exactly when region_kind == "cuda"
    replicated: bool = False  # every rank holds the same KV (MLA): one shard
    layer_signals: tuple[int, int] | None = None  # (pid, address): see copiers.signals
    owner_token: bytes = b""  # of the caller's previous registration, if any

    @property
    def shards(self) -> int:
        return 1 if self.replicated else self.tp_size


def _check_ident(value: str, field_name: str) -> None:
    if not value or len(value) > MAX_ID_LEN or not value.isprintable():
        raise InvalidRequest(
            f"{field_name}: must be 1..{MAX_ID_LEN} printable characters"
        )


def validate_spec(spec: RegisterSpec) -> None:
    _check_ident(spec.instance_id, "instance_id")
    _check_ident(spec.namespace, "namespace")
    if not 1 <= spec.tp_size <= MAX_TP:
        raise InvalidRequest(f"tp_size: {spec.tp_size} not in 1..{MAX_TP}")
    if not 0 <= spec.tp_rank < spec.tp_size:
        raise InvalidRequest(f"tp_rank: {spec.tp_rank} not in 0..{spec.tp_size - 1}")
    if not spec.tp_size <= spec.world_size <= MAX_TP * 64:
        raise InvalidRequest(
            f"world_size: {spec.world_size} must be >= tp_size ({spec.tp_size})"
        )
    if not _DEVICE_RE.match(spec.device):
        raise InvalidRequest(f"device: {spec.device!r} is not 'cpu' or 'cuda:N'")
    if not 1 <= len(spec.regions) <= MAX_REGIONS:
        raise InvalidRequest(f"regions: need 1..{MAX_REGIONS}, got {len(spec.regions)}")
    if (spec.region_kind == "host") != (spec.device == "cpu"):
        raise InvalidRequest(
            f"regions: {spec.region_kind} regions do not match device {spec.device}"
        )
    for i, (_, size) in enumerate(spec.regions):
        if size <= 0:
            raise InvalidRequest(f"regions[{i}].size: must be > 0")
    if (spec.cuda is None) != (spec.region_kind == "host"):
        raise InvalidRequest("regions: cuda regions need their ipc handles")
    if spec.cuda is not None:
        _check_cuda(spec.cuda, len(spec.regions))
    if spec.owner_token and len(spec.owner_token) != TOKEN_BYTES:
        raise InvalidRequest(
            f"owner_token: {len(spec.owner_token)} bytes, need {TOKEN_BYTES} or none"
        )
    validate_layers(spec.layers, [size for _, size in spec.regions])


def _check_cuda(cuda: CudaExport, regions: int) -> None:
    if len(cuda.ipc_handles) != regions:
        raise InvalidRequest("regions: every cuda region needs its ipc_handle")
    for i, h in enumerate(cuda.ipc_handles):
        if len(h) != IPC_HANDLE_BYTES:
            raise InvalidRequest(
                f"regions[{i}].cuda.ipc_handle: {len(h)} bytes, need {IPC_HANDLE_BYTES}"
            )
    if len(cuda.device_uuid) != UUID_BYTES:
        raise InvalidRequest(
            f"regions.cuda.device_uuid: {len(cuda.device_uuid)} bytes, need "
            f"{UUID_BYTES} (one device per worker)"
        )
    if len(cuda.event_handles) > MAX_EVENTS:
        raise InvalidRequest(f"event_handles: more than {MAX_EVENTS}")
    if any(len(h) != IPC_HANDLE_BYTES for h in cuda.event_handles):
        raise InvalidRequest(f"event_handles: each needs {IPC_HANDLE_BYTES} bytes")


def validate_layers(layers: tuple[LayerLayout, ...], region_sizes: list[int]) -> None:
    """Reject a layout that is empty, inconsistent, reaches outside a region, or
    whose blocks need too many copy descriptors for their bytes (limits)."""
    if not layers:
        raise InvalidRequest("layers: at least one layer is required")
    if len(layers) > MAX_LAYERS:
        raise InvalidRequest(f"layers: {len(layers)} layers exceeds {MAX_LAYERS}")
    num_blocks = layers[0].num_blocks
    for i, layer in enumerate(layers):
        field = f"layers[{i}]"
        if not 0 <= layer.region_index < len(region_sizes):
            raise InvalidRequest(
                f"{field}.region_index: {layer.region_index} but "
                f"{len(region_sizes)} region(s) registered"
            )
        if layer.num_blocks <= 0 or layer.num_blocks != num_blocks:
            raise InvalidRequest(
                f"{field}.num_blocks: {layer.num_blocks}; every layer needs the "
                f"same positive count ({num_blocks})"
            )
        if not 1 <= len(layer.segments) <= MAX_SEGMENTS_PER_LAYER:
            raise InvalidRequest(
                f"{field}.segments: need 1..{MAX_SEGMENTS_PER_LAYER}, got "
                f"{len(layer.segments)}"
            )
        if any(s.size <= 0 or s.offset < 0 for s in layer.segments):
            raise InvalidRequest(f"{field}.segments: sizes must be > 0, offsets >= 0")
        if layer.block_stride <= 0 and layer.num_blocks > 1:
            raise InvalidRequest(f"{field}.block_stride: must be > 0")
        end = layer.span_end()
        size = region_sizes[layer.region_index]
        if layer.offset < 0 or end > size:
            raise InvalidRequest(
                f"{field}: pages reach byte {end} but region "
                f"{layer.region_index} is {size} bytes"
            )
    where = first_overlap(layers)
    if where is not None:  # a load would write that memory twice, racing itself
        raise InvalidRequest(f"{where}; every page needs memory of its own")
    counts = [len(layer.segments) for layer in layers]
    limits.check_block_geometry(counts, [layer.page_bytes for layer in layers])
