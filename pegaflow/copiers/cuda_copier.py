"""CUDA copy engine: moves KV pages between engines' GPU memory and the pool.

Same seam as pegaflow.copiers.host_copier.HostCopyEngine (`open`, `gather`, `scatter`,
`close`), over pegaflow.kernels' CUDA backend: one kernel launch per save or
load moves every (layer, block) page, zero-copy between device memory opened
with CUDA IPC and the pool, registered mapped (cudaHostRegister). Saves and
loads run on separate streams with a capped grid each, so both directions
overlap and the engine keeps most SMs.

Each allocation an engine exports is opened once per server and closed
after its last worker (pegaflow.copiers.ipc_mappings).

A save may name an engine's interprocess event (`wait_event`). The server polls
that event from the copy thread and launches once it completed (bounded by
`event_timeout_s`) rather than queueing cudaStreamWaitEvent: on the H200 a
GPU-side wait for an engine SIGKILLed before its event hung the server (the
IPC close, a device-wide synchronization, then blocked the RPC loop for good).
Polling never leaves work in the server's context waiting on another process.
The engine itself never syncs; the copy starts within ~50 us of its event.

Each batch moves by kernel or by the copy engines (pegaflow.copiers.dma),
chosen per batch from its shape by a CopyPolicy: copy engines for saves of a
few blocks, kernels for the rest (measured.CROSSOVERS has the figures);
copy engines use no SMs. Both run on the direction's stream, so the choice
never reorders a save or a load. How the thread then waits for the batch
follows its path (measured.COMPLETION; pegaflow.copiers.completion).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from pegaflow import kernels
from pegaflow.common import cuda_driver, deadlines
from pegaflow.common.errors import CopyFailed, InvalidRequest
from pegaflow.common.geometry import Transfers

from . import dma, measured
from .completion import StreamFlag, wait_engine_event
from .copier import CudaExport
from .gpu_state import Faults, InFlight, Rates
from .ipc_mappings import IpcMappings, opened
from .measured import COMPLETION, FLAG_MAX_BYTES, PATHS
from .path_choice import CopyDirection, CopyPath, CopyPolicy, timed

logger = logging.getLogger(__name__)

DEFAULT_CTAS = 66  # half the H200's SMs per direction (benchmarks/RESULTS.md)


class PoolPins(Protocol):
    """Which chunks of the pool are pinned, while a restarted server still
    pins it (pegaflow.cache.pin_chunks.ChunkPins)."""

    complete: bool

    def chunks_of(self, addresses: np.ndarray, nbytes: np.ndarray) -> np.ndarray: ...
    def ready(self, chunks: np.ndarray) -> bool: ...
    def wait(self, chunks: np.ndarray, deadline: float | None, what: str) -> None: ...


@dataclass(slots=True)
class _Device:
    """One GPU the server serves: the pool's alias there, two streams and
    their completion flags (none where copy engines are off or the driver
    refuses stream writes)."""

    ordinal: int
    uuid: bytes
    pool: Any  # kernels Buffer over the whole pool, mapped
    save: Any  # numba streams
    load: Any
    flags: dict[CopyDirection, StreamFlag] = field(default_factory=dict)
    spare_events: list[tuple[Any, Any]] = field(default_factory=list)  # timing pairs

    def stream(self, direction: CopyDirection) -> Any:
        return self.save if direction == "save" else self.load


@dataclass(slots=True)
class Launched:
    """A batch queued by CudaCopyEngine.launch and not yet finished
    (pegaflow.copiers.copy_wait settles it): timing events around it, and when the
    direction's recent rate says it ends (None: no rate yet)."""

    dev: _Device
    direction: CopyDirection
    path: CopyPath
    t: Transfers
    events: tuple[Any, Any]  # recorded before and after the batch
    start: float  # perf_counter before the launch
    expected_end: float | None


@dataclass(slots=True)
class CudaRegions:
    """One worker's opened GPU memory (the handle Registry keeps)."""

    device: _Device
    keys: tuple[tuple[bytes, bytes], ...]  # (device uuid, ipc handle) per region
    bases: tuple[int, ...]  # server-side device address of each region
    sizes: tuple[int, ...]  # and its bytes
    buffer: Any  # kernels Buffer spanning every region
    events: tuple[Any, ...]  # opened interprocess events


class CudaCopyEngine:
    _pins: PoolPins | None = None  # None: the whole pool was pinned before

    def __init__(
        self,
        pool_base: int,
        pool_size: int,
        ordinals: list[int],
        max_ctas: int = DEFAULT_CTAS,
        event_timeout_s: float = 10.0,
        policy: CopyPolicy | None = None,
        pins: PoolPins | None = None,
    ) -> None:
        """pins: the pool's chunks pinned so far, where it is pinned beside
        serving; each copy waits for those it touches (`_pool_pinned`)."""
        if not ordinals:
            raise ValueError("ordinals: need at least one CUDA device")
        self._pins = pins
        self._k = kernels.backend("cuda")
        self._ctas = max_ctas
        self._policy = policy or CopyPolicy()
        self._dma = self._open_dma()
        self._attrs: dict[tuple[CopyDirection, int], dma.MemcpyAttributes] = {}
        self._timeout = event_timeout_s
        self._devices: dict[bytes, _Device] = {}
        self._ipc = IpcMappings()
        self._flights = InFlight()  # per (device, direction): launch, busy
        self._rates = Rates()  # per (device, direction, path): launch's estimate
        self._faults = Faults()
        for ordinal in ordinals:  # one to a few GPUs, at start-up
            cuda_driver.set_device(ordinal)
            pool = self._k.wrap(pool_base, pool_size, mapped=True)
            uuid = cuda_driver.device_uuid(ordinal)
            dev = _Device(ordinal, uuid, pool, self._k.stream(), self._k.stream())
            self._devices[uuid] = dev
            warm_up(self._k, dev.save)
            if self._dma is not None:
                dev.flags = self._open_flags(dev)
        logger.info(
            "CUDA copy engine on device(s) %s, %d CTAs, copy path %s",
            ordinals,
            max_ctas,
            self._policy.setting,
        )

    def _open_dma(self) -> dma.MemcpyBatch | None:
        """The driver's batch call, unless kernels do every copy. A driver
        without it (before CUDA 12.8) refuses --copy-path dma and turns
        "auto" into kernels only."""
        if self._policy.setting == "kernel":
            return None
        try:
            return dma.driver()
        except cuda_driver.CudaError as exc:
            if self._policy.setting == "dma":
                raise
            logger.warning("copy engines unavailable, kernels only: %s", exc)
            self._policy = CopyPolicy("kernel")
            return None

    def _open_flags(self, dev: _Device) -> dict[CopyDirection, StreamFlag]:
        """A flag per stream, each written once here; {} (stream syncs only)
        where the driver refuses stream memory operations or the word never
        changes (each wait would then spin its whole bound)."""
        flags: dict[CopyDirection, StreamFlag] = {}
        try:
            for direction, stream in (("save", dev.save), ("load", dev.load)):
                host, device = cuda_driver.mapped_word()
                probe = StreamFlag(host, device, cuda_driver.stream_write32, 1.0)
                sync = functools.partial(self._k.synchronize, stream)
                if not probe.wait(int(stream.handle), sync):
                    raise cuda_driver.CudaError("the first flag write never landed")
                flags[direction] = StreamFlag(host, device, cuda_driver.stream_write32)
        except CopyFailed as exc:  # CudaError, or the probe's synchronize
            logger.warning("stream flags unavailable, stream syncs only: %s", exc)
            return {}
        return flags

    @property
    def faults(self) -> dict[int, str]:
        """GPU ordinal -> the sticky fault that broke its context (/health)."""
        return dict(self._faults.reasons)

    def faulted(self) -> dict[int, bool]:
        """GPU ordinal -> whether a sticky fault broke it (/metrics)."""
        broken = self._faults.reasons
        return {d.ordinal: d.ordinal in broken for d in self._devices.values()}

    @property
    def policy(self) -> CopyPolicy:  # /stats and /metrics report its choices
        return self._policy

    @property
    def mapped_allocations(self) -> int:
        """Engine allocations currently IPC-mapped into the server."""
        return len(self._ipc)

    # -- open / close -----------------------------------------------------------
    def open(
        self, pid: int, regions: list[tuple[int, int]], cuda: CudaExport | None = None
    ) -> CudaRegions:
        """Map each region's allocation (once per allocation) and the events."""
        if cuda is None:
            raise InvalidRequest("regions: cuda regions need their ipc handles")
        dev = self._devices.get(cuda.device_uuid)
        if dev is None:
            raise InvalidRequest(
                f"regions.cuda.device_uuid: GPU {cuda.device_uuid.hex()} is not "
                "served by this server (see --devices)"
            )
        self._faults.check(dev.ordinal)
        cuda_driver.set_device(dev.ordinal)
        keys: list[tuple[bytes, bytes]] = []
        events: list[Any] = []
        try:
            bases = []
            for i, (handle, (offset, size)) in enumerate(
                zip(cuda.ipc_handles, regions, strict=True)
            ):
                key = (cuda.device_uuid, handle)
                mapping = self._ipc.acquire(key, i)
                keys.append(key)
                if offset + size > mapping.size:
                    raise InvalidRequest(
                        f"regions[{i}]: offset {offset} + size {size} leaves the "
                        f"{mapping.size}-byte allocation"
                    )
                bases.append(mapping.pointer + offset)
            for i, handle in enumerate(cuda.event_handles):
                events.append(opened(cuda_driver.open_ipc_event, handle, i))
            lo = min(bases)
            hi = max(b + size for b, (_, size) in zip(bases, regions, strict=True))
            if lo % 16 or hi - lo < 16:  # the copy kernels' 16-byte path
                raise InvalidRequest(
                    f"regions: they start at {lo:#x} and span {hi - lo} bytes; "
                    "the lowest must be 16-byte aligned and the span at least 16"
                )
            buffer = self._k.wrap(lo, hi - lo)
        except BaseException:
            self._ipc.release_all(dev.ordinal, keys, events)
            raise
        sizes = tuple(size for _, size in regions)
        return CudaRegions(dev, tuple(keys), tuple(bases), sizes, buffer, tuple(events))

    def close(self, regions: CudaRegions) -> None:
        """Drop the worker's events and mappings; runs once no copy is active."""
        ordinal = regions.device.ordinal
        self._ipc.release_all(ordinal, list(regions.keys), list(regions.events))

    # -- copies -----------------------------------------------------------------
    def gather(
        self,
        regions: CudaRegions,
        t: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Save: engine pages -> pool slots, after the engine's event if named.
        Not started past the deadline (the event may take long): the engine
        would not publish it, and nothing is written after a deadline."""
        dev = regions.device
        self._faults.check(dev.ordinal)  # before waiting for the event
        cuda_driver.set_device(dev.ordinal)
        if wait_event:
            with self._faults.noted(dev.ordinal):
                wait_engine_event(self._event(regions, wait_event), self._timeout)
        deadlines.check(deadline, "save")
        self._copy_now("save", regions, t, deadline)

    def event_done(self, regions: CudaRegions, wait_event: int) -> bool:
        """Whether the engine's event `wait_event` (1-based) completed: a save
        gated on it may then start at once, without waiting (and inline)."""
        cuda_driver.set_device(regions.device.ordinal)
        with self._faults.noted(regions.device.ordinal):
            return cuda_driver.event_done(self._event(regions, wait_event))

    def record_done(self, regions: CudaRegions, done_event: int) -> None:
        """Record the engine's event `done_event` after what the load stream
        holds (a launched load: the engine then knows it landed)."""
        dev, event = regions.device, self._event(regions, done_event, "done_event")
        with self._faults.noted(dev.ordinal):
            cuda_driver.record_event(event, int(dev.stream("load").handle))

    def check_event(self, regions: CudaRegions, index: int, field: str) -> None:
        self._event(regions, index, field)  # InvalidRequest naming `field`

    @staticmethod
    def _event(regions: CudaRegions, index: int, field: str = "wait_event") -> Any:
        if not 1 <= index <= len(regions.events):
            raise InvalidRequest(
                f"{field}: {index}, the worker registered "
                f"{len(regions.events)} event(s)"
            )
        return regions.events[index - 1]

    def scatter(
        self, regions: CudaRegions, t: Transfers, deadline: float | None = None
    ) -> None:
        """Load: pool slots -> engine pages; done (on the GPU) when this returns.
        Not launched after the deadline: the engine may reuse those blocks."""
        dev = regions.device
        cuda_driver.set_device(dev.ordinal)
        deadlines.check(deadline, "load")
        self._copy_now("load", regions, t, deadline)

    def _copy_now(
        self,
        direction: CopyDirection,
        regions: CudaRegions,
        t: Transfers,
        deadline: float | None = None,
    ) -> None:
        """Queue the batch and wait for it here (a copy thread, or the loop
        for a small one)."""
        dev = regions.device
        self._faults.check(dev.ordinal)
        self._pool_pinned(direction, t, deadline, wait=True)
        path = self._policy.choose_for(direction, t, dev.ordinal)
        key = (dev.ordinal, direction)
        # Batches the policy times are bracketed by events, as launched ones
        # are: both paths' rates are then GPU times, whichever way each went.
        events = self._timing_events(dev) if timed(len(t), t.total_bytes) else None
        stream = dev.stream(direction)
        self._flights.add(key, +1)
        try:
            start = time.perf_counter()  # the policy learns from each batch's time
            with self._drained_on_error(dev, stream):
                self._queue(direction, path, regions, t, events)
                if events is not None:
                    cuda_driver.record_event(events[1], int(stream.handle))
                self._finish(dev, direction, path, t)
            end = time.perf_counter()
            gpu_s = None
            if events is not None:
                # A host flag can be seen before the driver has the event as
                # done: such a batch is timed by the wall clock instead.
                with self._faults.noted(dev.ordinal):
                    if cuda_driver.event_done(events[1]):
                        gpu_s = cuda_driver.elapsed_s(*events)
            if gpu_s is not None:
                self._rates.learn((dev.ordinal, direction, path), t.total_bytes, gpu_s)
        finally:
            self._flights.add(key, -1)
            if events is not None:
                dev.spare_events.append(events)
        self._policy.observe(
            dev.ordinal, direction, path, t, start, end, gpu_s, self._pinned()
        )

    def _queue(
        self,
        direction: CopyDirection,
        path: CopyPath,
        regions: CudaRegions,
        t: Transfers,
        events: tuple[Any, Any] | None = None,
    ) -> None:
        """Enqueue the batch on its direction's stream, by `path`. events[0]
        goes in right before the copy: recorded before the host's planning on
        an idle stream, it timed that Python and any wait for the driver's
        lock (pinning holds it) as GPU time, which read as contention."""
        dev = regions.device
        stream = dev.stream(direction)
        started = None
        if events is not None:
            started = functools.partial(
                cuda_driver.record_event, events[0], int(stream.handle)
            )
        if direction == "save":
            src, dst = regions.buffer, dev.pool
        else:
            src, dst = dev.pool, regions.buffer
        if path == "dma":
            self._batch(direction, src, dst, t, dev, started)
        elif direction == "save":
            self._k.gather(
                src, dst, t, stream=stream, max_blocks=self._ctas, before_launch=started
            )
        else:
            self._k.scatter(
                src, dst, t, stream=stream, max_blocks=self._ctas, before_launch=started
            )

    # -- launched on the event loop (pegaflow.copiers.copy_wait)
    # ------------------------
    def launch(
        self,
        direction: CopyDirection,
        regions: CudaRegions,
        t: Transfers,
        deadline: float | None = None,
    ) -> Launched | None:
        """Queue a save (no engine event) or a load and return at once; None
        when the batch must go by a copy thread instead: its stream has a
        batch in flight (gpu_state.InFlight.busy), or its size class's rate
        says it runs longer than measured.LOOP_MAX_S."""
        dev = regions.device
        self._faults.check(dev.ordinal)
        if not self._pool_pinned(direction, t, deadline, wait=False):
            return None  # a copy thread waits for its chunks, not the loop
        if self._too_long_for_loop(dev.ordinal, direction, t.total_bytes):
            return None
        if not self._flights.claim((dev.ordinal, direction)):
            return None
        events: tuple[Any, Any] | None = None
        try:
            # Chosen only once nothing can send the batch to a copy thread:
            # the policy may hand it a due probe (a kernel batch to see if
            # contention ended, the losing path's re-timing), which the
            # thread's own choice would no longer be given.
            path = self._policy.choose_for(direction, t, dev.ordinal)
            rate = self._rates.rate((dev.ordinal, direction, path), t.total_bytes)
            cuda_driver.set_device(dev.ordinal)
            deadlines.check(deadline, direction)
            events = self._timing_events(dev)
            stream = dev.stream(direction)
            handle = int(stream.handle)
            start = time.perf_counter()
            with self._drained_on_error(dev, stream):
                self._queue(direction, path, regions, t, events)
                cuda_driver.record_event(events[1], handle)
        except BaseException:
            if events is not None:
                dev.spare_events.append(events)
            self._flights.add((dev.ordinal, direction), -1)
            raise
        queued = time.perf_counter()
        expected = None if rate is None else queued + t.total_bytes / rate
        return Launched(dev, direction, path, t, events, start, expected)

    def _too_long_for_loop(
        self, device: int, direction: CopyDirection, nbytes: int
    ) -> bool:
        """Whether the batch runs longer than measured.LOOP_MAX_S even by the
        faster path's recent rate (it is judged before the path is chosen);
        False before either path was timed."""
        rates = [self._rates.rate((device, direction, p), nbytes) for p in PATHS]
        known = [r for r in rates if r is not None]
        return bool(known) and nbytes / max(known) > measured.LOOP_MAX_S

    def _pinned(self) -> bool:
        """Whether the whole pool is pinned (until then, see contention.py)."""
        return self._pins is None or self._pins.complete

    def busy(self, regions: CudaRegions, direction: CopyDirection) -> bool:
        """Whether a copy started now on the event loop could wait there
        (gpu_state.InFlight.busy): such a copy goes by a copy thread. So
        could any copy while the pool is still being pinned: it goes by
        launch, which asks for its chunks without waiting."""
        if not self._pinned():
            return True
        return self._flights.busy((regions.device.ordinal, direction))

    def _pool_pinned(
        self,
        direction: CopyDirection,
        t: Transfers,
        deadline: float | None,
        wait: bool,
    ) -> bool:
        """Whether the pool chunks the copy's slots lie in are pinned (they
        are pinned next if not). A kernel or DMA on an unpinned one would
        break the context for good. wait: block this thread until they are,
        at most until the deadline (DeadlineExceeded: nothing copied), or
        until pinning failed (DeviceBroken)."""
        pins = self._pins
        if pins is None or pins.complete:
            return True
        slots = t.dst if direction == "save" else t.src
        chunks = pins.chunks_of(slots, t.nbytes)
        if not wait:
            return pins.ready(chunks)
        pins.wait(chunks, deadline, direction)
        deadlines.check(deadline, direction)  # pinned as the deadline passed
        return True

    def launched_done(self, launched: Launched) -> bool:
        """Whether the batch finished; a fault in it raises CopyFailed."""
        cuda_driver.set_device(launched.dev.ordinal)
        with self._faults.noted(launched.dev.ordinal):
            return cuda_driver.event_done(launched.events[1])

    def wait_launched(self, launched: Launched) -> None:
        """Block until the batch finished (a copy thread calls this)."""
        dev = launched.dev
        cuda_driver.set_device(dev.ordinal)
        with self._faults.noted(dev.ordinal):
            self._k.synchronize(dev.stream(launched.direction))

    def finish_launched(self, launched: Launched, failed: bool = False) -> None:
        """After the batch is done, or after waiting for it failed (then its
        stream is drained first: the caller frees what it writes). Its GPU
        time feeds the next estimates (gpu_state.Rates)."""
        dev, direction, t = launched.dev, launched.direction, launched.t
        try:
            cuda_driver.set_device(dev.ordinal)
            if failed:
                self._drain(dev.stream(direction))
                return
            with self._faults.noted(dev.ordinal):
                seconds = cuda_driver.elapsed_s(*launched.events)
            key = (dev.ordinal, direction, launched.path)
            self._rates.learn(key, t.total_bytes, seconds)
            end = launched.start + seconds
            self._policy.observe(
                dev.ordinal, direction, launched.path, t, launched.start, end,
                seconds, self._pinned(),
            )  # fmt: skip
        finally:
            dev.spare_events.append(launched.events)
            self._flights.add((dev.ordinal, direction), -1)

    @staticmethod
    def _timing_events(dev: _Device) -> tuple[Any, Any]:
        """A pair from the device's spares, or a new one (list pop and append
        are atomic: the loop and a failing thread may both return pairs)."""
        try:
            return dev.spare_events.pop()
        except IndexError:
            return cuda_driver.create_timing_event(), cuda_driver.create_timing_event()

    @contextlib.contextmanager
    def _drained_on_error(self, dev: _Device, stream: Any) -> Iterator[None]:
        """A failure after part of a copy was queued (the second of two DMA
        batches, the event record after a launch) must not return while that
        part still runs: the caller frees or unpins the slots it writes. A
        sticky fault among them marks the GPU broken (gpu_state.Faults)."""
        try:
            yield
        except BaseException as exc:
            self._drain(stream)
            self._faults.note(dev.ordinal, exc)
            raise

    def _drain(self, stream: Any) -> None:
        """Wait for whatever still runs on `stream` after a failure."""
        try:
            self._k.synchronize(stream)
        except Exception as exc:  # the context is broken: nothing runs on it
            logger.error("stream sync after a failed copy failed: %s", exc)

    def _finish(
        self, dev: _Device, direction: CopyDirection, path: CopyPath, t: Transfers
    ) -> None:
        """Wait for the batch just queued: COMPLETION's way for its path."""
        stream = dev.stream(direction)
        flag = dev.flags.get(direction)
        if flag is None or COMPLETION[path] != "flag" or t.total_bytes > FLAG_MAX_BYTES:
            self._k.synchronize(stream)
            return
        flag.wait(int(stream.handle), functools.partial(self._k.synchronize, stream))

    def _batch(self, direction: CopyDirection, src: Any, dst: Any, t: Transfers,
               dev: _Device, started: Callable[[], None] | None) -> None:  # fmt: skip
        """Enqueue `t` on the direction's stream as copy-engine batches."""
        assert self._dma is not None  # a "kernel" policy never chooses DMA
        key = (direction, dev.ordinal)
        attrs = self._attrs.get(key)
        if attrs is None:
            attrs = self._attrs[key] = dma.attributes(direction, dev.ordinal)
        stream = dev.stream(direction)
        chunks = (dev.pool.address, cuda_driver.POOL_CHUNK_BYTES)
        planned = dma.plan(src, dst, t, chunks)
        if started is not None:
            started()
        self._dma(planned, attrs, int(stream.handle))


def warm_up(k: ModuleType, stream: Any) -> None:
    """Compile the copy kernel of backend `k` now (about a second), not in the
    first save, and load it on `stream`.

    On scratch memory, never the pool: a kept --pool-file holds the last
    server's blocks, and a copy inside the pool changed the first slot's bytes
    (its checksum then failed: one block lost per restart)."""
    scratch = k.staging_buffer(32)
    base = np.uint64(scratch.address)
    one = np.ones(1, np.uint64) * np.uint64(16)
    t = Transfers(np.array([base]), np.array([base + np.uint64(16)]), one)
    k.copy_descriptors(scratch, scratch, t, stream=stream)
    k.synchronize(stream)
