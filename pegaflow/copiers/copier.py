"""The copy seam: what moves bytes between an engine's KV memory and the pool.

One CopyEngine per kind of engine memory: pegaflow.copiers.host_copier for host KV
(process_vm_readv/writev, pegaflow.copiers.vm), pegaflow.copiers.cuda_copier for GPU KV
(numba kernels of pegaflow.kernels over CUDA IPC mappings). The engine hands a
copier descriptor tables (pegaflow.common.geometry.Transfers) built from validated
requests; a table that breaks a copier's own checks is our bug (InternalError).
Per-layer load progress is pegaflow.copiers.layer_signals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pegaflow.common.geometry import Transfers

RegionKind = Literal["host", "cuda"]


@dataclass(frozen=True, slots=True)
class CudaExport:
    """What a GPU worker sends beside its (offset, size) regions."""

    ipc_handles: tuple[bytes, ...]  # one per region: its allocation's handle
    device_uuid: bytes
    event_handles: tuple[bytes, ...] = ()  # SaveRequest.wait_event picks one


class CopyEngine(Protocol):
    """Opens one worker's KV memory once, then moves descriptor tables between
    it and pool slots. No copy starts after `deadline` (time.monotonic()
    seconds): the copier checks it right before each system call or launch."""

    def open(
        self,
        pid: int,
        regions: list[tuple[int, int]],
        cuda: CudaExport | None = None,
    ) -> object: ...
    def gather(
        self,
        handle: object,
        transfers: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Engine -> pool; wait_event (CUDA only): after the engine's event."""

    def event_done(self, handle: object, wait_event: int) -> bool:
        """Whether a save gated on wait_event could start now (CUDA only;
        InvalidRequest where gather would refuse that event)."""

    def scatter(
        self, handle: object, transfers: Transfers, deadline: float | None = None
    ) -> None:
        """Pool -> engine."""

    def close(self, handle: object) -> None:
        """After the handle's last copy."""


class LoadSignals(Protocol):
    """Per-layer progress words an engine polls (pegaflow.copiers.layer_signals)."""

    def signal(self, layer: int, seq: int) -> None: ...
    def close(self) -> None: ...


# (pid, address, num_layers) -> the engine's signal words, checked and opened
OpenSignals = Callable[[int, int, int], LoadSignals]
