"""Engine side of the GPU data path: describe torch CUDA KV tensors for the server.

`export_kv` turns per-layer KV tensors (vLLM 0.33 views into one int8 buffer,
K/V-first per-layer tensors, MLA) into regions the server can open: for each
storage, the CUDA IPC handle of the cudaMalloc allocation that holds it
(found with cuMemGetAddressRange), the storage's offset in that allocation, its
size and the device UUID. `IpcEvents` are interprocess events that order the
server's save after the engine's compute without a host sync in the engine,
and tell the engine a load's copy is done without a reply from the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pegaflow.common import cuda_driver
from pegaflow.common.geometry import LayerLayout

from .event_wait import LoadWaits
from .kv_layouts import describe

DEFAULT_EVENTS = 4  # saves in flight at once per worker, each with its own event
DEFAULT_LOAD_EVENTS = 4  # loads a worker waits for at once, one event each


@dataclass(frozen=True, slots=True)
class CudaRegion:
    ipc_handle: bytes  # of the allocation base
    offset: int  # of the KV bytes from the allocation base
    size: int
    device_uuid: bytes


@dataclass(frozen=True, slots=True)
class CudaKVMemory:
    device: str  # "cuda:N" in the engine's numbering
    regions: tuple[CudaRegion, ...]
    layers: tuple[LayerLayout, ...]  # offsets from each region's first byte


def export_kv(tensors: Sequence[Any], kv_first: bool = False) -> CudaKVMemory:
    """Regions (IPC-exported) and layer layouts of per-layer torch CUDA tensors."""
    if not tensors:
        raise ValueError("tensors: at least one KV tensor is required")
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"tensors: need CUDA tensors of one device, got {devices}")
    ordinal = next(iter(devices)).index or 0
    cuda_driver.set_device(ordinal)  # the driver calls below need its context
    uuid = cuda_driver.device_uuid(ordinal)
    mem = describe(tensors, kv_first=kv_first)
    regions = []
    for address, size in mem.regions:  # one per storage: a handful
        base, alloc = cuda_driver.allocation_of(address)
        if address + size > base + alloc:
            raise ValueError(f"storage at {address:#x} leaves its allocation")
        handle = cuda_driver.ipc_mem_handle(base)
        regions.append(CudaRegion(handle, address - base, size, uuid))
    return CudaKVMemory(f"cuda:{ordinal}", tuple(regions), mem.layers)


class IpcEvents:
    """A ring of interprocess events; `record` marks the end of a step's KV
    writes on the engine's stream and names the event for SaveRequest.wait_event.

    An event is re-recorded only `count` saves later; a save still waiting on
    it would then wait for the newer record, which only delays it. The last
    `loads` events are the server's to record after a load's copy
    (`load_event`, `wait`); a save never names one.
    """

    def __init__(
        self,
        ordinal: int,
        count: int = DEFAULT_EVENTS,
        loads: int = DEFAULT_LOAD_EVENTS,
    ) -> None:
        if count < 1 or loads < 0:
            raise ValueError(f"count, loads: need >= 1 and >= 0, got {count}, {loads}")
        cuda_driver.set_device(ordinal)
        made = [cuda_driver.create_ipc_event() for _ in range(count + loads)]
        self._events = [event for event, _ in made]
        self.handles: tuple[bytes, ...] = tuple(handle for _, handle in made)
        self._saves, self._next, self._next_load = count, 0, 0
        self._waits = LoadWaits()

    def record(self, stream: int) -> int:
        """Record the next event on `stream` (a cudaStream_t as int); returns its
        1-based index, the value for `PegaflowClient.save(wait_event=...)`."""
        i = self._next
        self._next = (i + 1) % self._saves
        cuda_driver.record_event(self._events[i], stream)
        return i + 1

    def load_event(self) -> int:
        """The next load event's 1-based index, for `PegaflowClient.load(
        done_event=...)`; 0 where none were made. One recorded again (a later
        load's, on the same server stream) only delays an earlier waiter."""
        loads = len(self._events) - self._saves
        if not loads:
            return 0
        i = self._next_load
        self._next_load = (i + 1) % loads
        return self._saves + i + 1

    def wait(self, index: int, timeout_s: float, nbytes: int, sent_at: float,
             hang_up_fd: int = -1) -> None:  # fmt: skip
        """Until the server's record of load event `index` completed: the copy
        it follows landed (pegaflow.client.event_wait; CopyFailed if it failed,
        if the connection `hang_up_fd` it went out on ended first, or if it did
        not land within timeout_s: the blocks may then hold anything). A load
        of `nbytes` went out at `sent_at` (time.monotonic())."""
        event = self._events[index - 1]
        self._waits.wait(event, index, timeout_s, nbytes, sent_at, hang_up_fd)

    def close(self) -> None:
        for event in self._events:
            cuda_driver.destroy_event(event)
        self._events = []
