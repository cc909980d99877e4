"""One-sided reads of a peer's pool: the narrow interface the remote tier needs
(register, read a batch or submit one and wait for it later, endpoint, close)
and its Mooncake Transfer Engine implementation. Another engine (NIXL, whose
transfers are posted and then polled the same way) stands in by implementing
RemoteTransport.

Mooncake serves reads of registered memory only: a read outside what the owner
registered is refused by the owner's engine (the TCP engine thread, or the NIC's
memory-region check over RDMA), so a reader cannot reach past the pool. There is
no authentication on the data path itself: its ports must be reachable from the
cluster only (docs/multinode.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)

# Mooncake's own advice: one batch at most ~1 GiB, and registrations it can map
# in one piece (4 GiB regions registered in parallel at start).
MAX_BATCH_BYTES = 1 << 30
MAX_REGISTER_BYTES = 4 << 30


class TransportError(RuntimeError):
    """A read that did not complete: its destination bytes are undefined.

    in_flight: some of its bytes may still land in the local addresses, at any
    later time. Mooncake reports a batch failed at its first failed task, and
    stops waiting at its own timeout, while the batch's other tasks still run
    (they cannot be cancelled, and Python sees no per-task status); so the
    addresses must not be reused before `quarantine_s()` has passed."""

    def __init__(self, message: str, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


Wait = Callable[..., None]  # wait(retry: bool = True) -> None

# A task of a failed batch still running this long after the failure is beyond
# anything Mooncake's own timeouts allow (its status gives up after the batch's
# bytes at 1 GiB/s plus MC_TRANSFER_TIMEOUT; a TCP slice without progress for
# MC_TCP_PROGRESS_TIMEOUT_SEC fails): several times the longer of the two.
_QUARANTINE_MIN_S = 60.0
_QUARANTINE_TIMEOUTS = 4


def quarantine_s() -> float:
    """How long local addresses of a read that failed with bytes in flight are
    kept from reuse (from Mooncake's timeouts as this process configured them)."""
    timeouts = [5.0]  # Mooncake's floor for MC_TRANSFER_TIMEOUT
    for name in ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC"):
        try:
            timeouts.append(float(os.environ.get(name, "0")))
        except ValueError:
            continue
    return max(_QUARANTINE_MIN_S, _QUARANTINE_TIMEOUTS * max(timeouts))


class RemoteTransport(Protocol):
    retried: int  # reads refused at submission, then read successfully

    def register(self, base: int, size: int) -> None: ...

    def read(
        self, endpoint: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
    ) -> None:
        """Copy lengths[i] bytes from the peer's remote[i] to our local[i]
        (uint64 arrays); raises TransportError."""
        ...

    def submit(
        self, endpoint: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
    ) -> Wait:
        """Start that read; the call returned waits until the engine reported
        on every part of it, then raises TransportError if it failed (with
        in_flight set when bytes may still land; with retry=False: without
        trying again first, where retrying is safe at all). An engine without
        asynchronous reads may read inside that call."""
        ...

    @property
    def endpoint(self) -> str: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TransportSettings:
    protocol: str  # "tcp" | "rdma"
    host: str  # the routable address peers reach us at
    nics: tuple[str, ...] = ()
    # A read making no progress this long is abandoned (a stopped peer).
    progress_timeout_s: int = 5


def _configure_environment(settings: TransportSettings) -> None:
    """Mooncake reads these at engine creation; set only what the operator did
    not. Why each: a stopped peer must not hang a read (progress timeout); its
    TCP sockets listen on our routable address, not every interface."""
    defaults = {
        "MC_TCP_PROGRESS_TIMEOUT_SEC": str(settings.progress_timeout_s),
        "MC_TRANSFER_TIMEOUT": str(settings.progress_timeout_s),
        "MC_TCP_BIND_ADDRESS": settings.host,
        # 4 MiB slices: +30% over the default on a loopback TCP read of 2 MiB
        # blocks (1.70 vs 1.29 GB/s, raw socket 1.91; benchmarks/RESULTS.md)
        "MC_TCP_SLICE_SIZE": str(4 << 20),
        "MC_LOG_LEVEL": "WARNING",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


class MooncakeTransport:
    """Batch reads (batch_transfer_async_read, then its status) over
    Mooncake's TCP or RDMA transport, peers found by its P2P handshake (no
    etcd)."""

    def __init__(self, settings: TransportSettings) -> None:
        _configure_environment(settings)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # the `remote` extra, or libibverbs1/libnuma1
            raise TransportError(
                f"mooncake transfer engine unavailable ({exc}); install the "
                "'remote' extra (pip install 'pegaflow-py[remote]') and the "
                "system libraries libibverbs1 and libnuma1"
            ) from exc
        self._engine = TransferEngine()
        device = ",".join(settings.nics)
        rc = self._engine.initialize(
            settings.host, "P2PHANDSHAKE", settings.protocol, device
        )
        if rc != 0:
            raise TransportError(
                f"mooncake {settings.protocol} transport failed to start on "
                f"{settings.host} (rc {rc})"
            )
        self._endpoint = _endpoint(settings.host, self._engine.get_rpc_port())
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()  # register/close vs reads
        self.retried = 0  # reads refused at submission, then read successfully

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, base: int, size: int) -> None:
        rc = self._engine.register_memory(base, size)
        if rc != 0:
            raise TransportError(f"registering {size} B at {base:#x} failed (rc {rc})")
        with self._lock:
            self._registered.append((base, size))

    def read(
        self, endpoint: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
    ) -> None:
        self.submit(endpoint, local, remote, lengths)()

    def submit(
        self, endpoint: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
    ) -> Wait:
        pending = []  # (batch id or 0 when refused at submission, its arrays)
        try:
            for start, stop in batches(lengths, MAX_BATCH_BYTES):
                args = tuple(
                    np.ascontiguousarray(a[start:stop], np.uint64)
                    for a in (local, remote, lengths)
                )
                batch = self._engine.batch_transfer_async_read(endpoint, *args)
                pending.append((batch, args))
        except BaseException as exc:  # the batches already submitted still land
            landing = [batch for batch, _ in pending if batch]
            if any(self._engine.get_batch_transfer_status([b]) != 0 for b in landing):
                raise TransportError(
                    f"read from {endpoint} failed while being submitted", True
                ) from exc
            raise

        def wait(retry: bool = True) -> None:
            refused, failed = [], False
            for batch, args in pending:  # every batch waited for, failed or not
                if batch == 0:
                    refused.append(args)  # nothing of it in flight
                elif self._engine.get_batch_transfer_status([batch]) != 0:
                    failed = True
            if failed:  # never read again into addresses that may still change
                raise TransportError(f"read from {endpoint} failed", in_flight=True)
            if refused and not retry:
                raise TransportError(f"read from {endpoint} refused at submission")
            for args in refused:
                # 0.3.13.post1/0.3.14: the first transfer after a few idle
                # seconds can be refused (Mooncake issue 4209); once is a retry.
                if self._engine.batch_transfer_sync_read(endpoint, *args) != 0:
                    raise TransportError(f"read from {endpoint} failed", True)
                self.retried += 1

        return wait

    def close(self) -> None:
        with self._lock:
            regions, self._registered = self._registered, []
        for base, _ in regions:
            self._engine.unregister_memory(base)


def batches(lengths: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges of at most `limit` bytes each (a single
    longer entry is a batch of its own)."""
    if len(lengths) == 0:
        return []
    ends = np.cumsum(lengths, dtype=np.int64)
    cuts = [0]
    base = 0
    while cuts[-1] < len(lengths):
        stop = int(np.searchsorted(ends, base + limit, side="right"))
        stop = max(stop, cuts[-1] + 1)
        cuts.append(stop)
        base = int(ends[stop - 1])
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
