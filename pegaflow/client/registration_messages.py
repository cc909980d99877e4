"""RegisterInstanceRequest messages from an engine's description of its KV
memory: host regions (pegaflow.kv_layouts.describe) or CUDA IPC exports
(pegaflow.client.cuda_export.export_kv). The client sends them; nothing here talks
to the server."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pegaflow.common.geometry import LayerLayout
from pegaflow.proto import pegaflow_pb2 as pb

if TYPE_CHECKING:
    from .cuda_export import CudaKVMemory

logger = logging.getLogger(__name__)


def host_request(
    instance_id: str,
    namespace: str,
    pid: int,
    regions: Sequence[tuple[int, int]],
    layers: Sequence[LayerLayout],
    tp_rank: int = 0,
    tp_size: int = 1,
    world_size: int | None = None,
    replicated: bool = False,
    layer_signals: int = 0,
) -> pb.RegisterInstanceRequest:
    req = _register_request(
        instance_id, namespace, tp_rank, tp_size, world_size, replicated
    )
    req.device = "cpu"
    req.regions.extend(
        pb.MemoryRegion(host=pb.HostRegion(pid=pid, address=a, size=n))
        for a, n in regions
    )
    req.layers.extend(_layer_message(layer) for layer in layers)
    _set_signals(req, layer_signals)
    return req


def cuda_request(
    instance_id: str,
    namespace: str,
    kv: CudaKVMemory,
    event_handles: Sequence[bytes] = (),
    tp_rank: int = 0,
    tp_size: int = 1,
    world_size: int | None = None,
    replicated: bool = False,
    layer_signals: int = 0,
) -> pb.RegisterInstanceRequest:
    req = _register_request(
        instance_id, namespace, tp_rank, tp_size, world_size, replicated
    )
    req.device = kv.device
    for r in kv.regions:
        cuda = pb.CudaRegion(
            ipc_handle=r.ipc_handle,
            offset=r.offset,
            size=r.size,
            device_uuid=r.device_uuid,
        )
        req.regions.append(pb.MemoryRegion(cuda=cuda))
    req.layers.extend(_layer_message(layer) for layer in kv.layers)
    req.event_handles.extend(event_handles)
    _set_signals(req, layer_signals)
    return req


def _register_request(
    instance_id: str,
    namespace: str,
    tp_rank: int,
    tp_size: int,
    world_size: int | None,
    replicated: bool,
) -> pb.RegisterInstanceRequest:
    return pb.RegisterInstanceRequest(
        instance_id=instance_id,
        namespace=namespace,
        tp_rank=tp_rank,
        tp_size=tp_size,
        world_size=world_size or tp_size,
        replicated=replicated,
    )


def _set_signals(req: pb.RegisterInstanceRequest, address: int) -> None:
    if address:
        req.layer_signals.pid = os.getpid()
        req.layer_signals.address = address


def _layer_message(layer: LayerLayout) -> pb.LayerLayout:
    return pb.LayerLayout(
        region_index=layer.region_index,
        offset=layer.offset,
        num_blocks=layer.num_blocks,
        block_stride=layer.block_stride,
        segments=[pb.Segment(offset=s.offset, size=s.size) for s in layer.segments],
    )


PR_SET_PTRACER = 0x59616D61


def allow_ptrace_from(pid: int) -> None:
    """Let the server read/write our KV memory where Yama restricts ptrace."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to allow
        logger.debug("prctl(PR_SET_PTRACER) unavailable")
