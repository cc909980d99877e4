"""Engines' GPU allocations opened in the server through CUDA IPC, once each.

Each allocation an engine exports is opened once per server (refcounted by
its (device uuid, handle) key), however many regions or re-registrations
name it, and closed on a background thread when its last worker goes away:
cudaIpcCloseMemHandle may synchronize the device, which must never stall the
RPC loop. A worker's interprocess events are destroyed on that thread too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from pegaflow.common import cuda_driver
from pegaflow.common.errors import CopyFailed, InvalidRequest

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # a re-opened allocation waits this long for its old close

Key = tuple[bytes, bytes]  # (device uuid, ipc handle)


@dataclass(slots=True)
class Mapping:
    pointer: int  # where the allocation is mapped in the server
    size: int
    refs: int


class IpcMappings:
    def __init__(self) -> None:
        self._open: dict[Key, Mapping] = {}
        self._closing: dict[Key, Mapping] = {}
        self._lock = threading.Lock()
        # A daemon thread: a close that never returns must not block exit.
        self._reaper: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        threading.Thread(target=self._reap, daemon=True, name="cuda-close").start()

    def __len__(self) -> int:
        """Allocations mapped now, those still closing included."""
        return len(self._open) + len(self._closing)

    def acquire(self, key: Key, index: int) -> Mapping:
        """The allocation's mapping, opened if this is its first reference."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while key in self._closing:  # re-registered right after unregistering
            if time.monotonic() > deadline:
                raise CopyFailed(f"regions[{index}]: its old mapping is still closing")
            time.sleep(1e-3)
        with self._lock:
            mapping = self._open.get(key)
            if mapping is None:
                pointer = opened(cuda_driver.open_ipc_memory, key[1], index)
                _, size = cuda_driver.address_range(pointer)
                mapping = self._open[key] = Mapping(pointer, size, 0)
                logger.debug("mapped allocation at %#x (%d bytes)", pointer, size)
            mapping.refs += 1
            return mapping

    def release_all(self, ordinal: int, keys: list[Key], events: list[Any]) -> None:
        """Drop references now; destroy events and unmap on the reaper thread."""
        unmap = []
        with self._lock:
            for key in keys:
                mapping = self._open[key]
                mapping.refs -= 1
                if mapping.refs == 0:
                    unmap.append(key)
                    self._closing[key] = self._open.pop(key)
        if unmap or events:
            self._reaper.put((ordinal, unmap, events))

    def _reap(self) -> None:
        """Destroy events and unmap allocations, one worker's batch at a time."""
        while True:
            ordinal, keys, events = self._reaper.get()
            try:
                cuda_driver.set_device(ordinal)
                for event in events:
                    cuda_driver.destroy_event(event)
            except Exception:  # a background loop: log, keep serving
                logger.exception("destroying a worker's CUDA events failed")
            for key in keys:
                try:
                    cuda_driver.close_ipc_memory(self._closing[key].pointer)
                except Exception:
                    logger.exception("closing a worker's CUDA mapping failed")
                with self._lock:
                    del self._closing[key]


def opened(fn: Any, handle: bytes, index: int) -> Any:
    """Open an IPC handle; a handle that does not open is the client's error."""
    try:
        return fn(handle)
    except cuda_driver.CudaError as exc:
        field = "event_handles" if fn is cuda_driver.open_ipc_event else "regions"
        raise InvalidRequest(
            f"{field}[{index}]: cannot open the handle ({exc})"
        ) from None
