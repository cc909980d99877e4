"""How the server runs one copy between the pool and an engine.

A copy that may reach a host engine's memory through process_vm_* runs on
that registration's own lane (pegaflow.copiers.engine_lane), never on the
loop or a shared thread: the engine can make such a copy wait as long as it
likes. One copy of a registration at a time takes the lane, at most
engine_lane.MAX_WAITING more wait for it, and only then does a copy take a
large-request slot, so a stalled engine holds at most one.
Other small copies run inline on the event loop (unless the engine's GPU
stream already holds one: queued behind it, the loop would wait for both); a
copier that launches (the CUDA one) queues the copy from the loop and the
loop awaits its completion (pegaflow.copiers.copy_wait); the rest run on a
copy thread. Every way passes the large-request gate first and keeps the
worker's memory open (its active_ops) until the copy ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pegaflow.cache.instances import Registry, Worker
from pegaflow.common.errors import DeadlineExceeded, Overloaded, UnknownInstance
from pegaflow.common.geometry import Transfers
from pegaflow.common.pidfds import ProcessChanged
from pegaflow.common.request_limits import LargeRequestGate
from pegaflow.copiers import copy_wait
from pegaflow.copiers.engine_lane import MAX_WAITING, EngineLane

from .metrics import Metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def uncancellable(work: Awaitable[T]) -> T:
    """Await work that must finish even if the RPC is cancelled (its client
    died): still wait for it before re-raising. A copy thread keeps reading
    or writing the worker's memory and the pool slots, and a mapping being
    made must be recorded for close to unmap: freeing either first (unmapping
    the engine's IPC memory, reusing the slots) would let it copy into memory
    that is gone or taken. Seen on the H200: an engine SIGKILLed mid-save.
    A cancel repeated meanwhile is absorbed too (the first then re-raised),
    except once the server stops (stopping()): a copy stalled in an
    engine's memory must not hold the process's exit."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                if asyncio.get_running_loop() in _STOPPING:
                    raise
        if not task.cancelled() and task.exception() is not None:
            logger.debug("work of a cancelled RPC failed: %s", task.exception())
        raise


# Event loops whose server is stopping (uncancellable then lets a repeated
# cancel through: asyncio.run's own, on the way out).
_STOPPING: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def stopping() -> None:
    """The running loop's server stops: see uncancellable."""
    _STOPPING.add(asyncio.get_running_loop())


class CopyDispatch:
    def __init__(
        self,
        registry: Registry,
        gate: LargeRequestGate,
        inline_copy_bytes: int,
        metrics: Metrics,
        process_changed: Callable[[Worker], None],
    ) -> None:
        """process_changed: drops a worker whose process exec'd or changed
        rights since it registered (its copy raised ProcessChanged)."""
        self._registry = registry
        self._gate = gate
        self._inline_bytes = inline_copy_bytes
        self._process_changed = process_changed
        waits = metrics.copy_waits  # labels() costs a few us: once each
        ways = ("loop", "late", "thread", "lane")
        self._waits = {way: waits.labels(way) for way in ways}

    async def run(
        self,
        worker: Worker,
        fn: Callable[[object, Transfers], None],
        t: Transfers,
        inline: bool = True,
        deadline: float | None = None,
        launch_as: str | None = None,
        *,
        direction: str,
        layer_wise: bool = False,
        on_launch: Callable[[], None] | None = None,
    ) -> float:
        """The copy's seconds. deadline: time.monotonic() seconds; no copy
        starts after it. launch_as ("save" or "load"): `fn` is that plain
        direction, which a copier that launches may queue from here.
        direction: "save" (engine -> pool) or "load"; layer_wise: `fn` also
        writes the engine's layer signal words. on_launch: called once a
        launched copy is queued, before it is waited for (never for a copy
        that runs here or on a thread)."""
        worker.active_ops += 1  # before the gate: keeps the memory open meanwhile
        start = time.perf_counter()
        try:
            lane = _lane(worker, t, direction, layer_wise)
            if lane is not None:
                async with (
                    _lane_turn(worker, lane, deadline),
                    self._gate.admit(len(t), deadline),
                ):
                    job = lane.runner.submit(fn, worker.handle, t)
                    await uncancellable(asyncio.wrap_future(job))
                self._waits["lane"].inc()
                return time.perf_counter() - start
            async with self._gate.admit(len(t), deadline):
                small = t.total_bytes <= self._inline_bytes
                if inline and small and not _stream_busy(worker, launch_as):
                    fn(worker.handle, t)
                elif launched := _launch(worker, launch_as, t, deadline):
                    settle = copy_wait.settle(worker.copier, launched)
                    if on_launch is not None:
                        try:
                            on_launch()
                        except Exception:  # the copy is waited for all the same
                            logger.exception("after launching a copy")
                    on_loop = await uncancellable(settle)
                    self._waits["loop" if on_loop else "late"].inc()
                else:
                    await uncancellable(asyncio.to_thread(fn, worker.handle, t))
                    self._waits["thread"].inc()
        except ProcessChanged as exc:
            # Its registration ends, leases and all, as if its session closed.
            if self._registry.is_current(worker):
                logger.warning(
                    "%s rank %d: %s", worker.instance_id, worker.tp_rank, exc
                )
                self._process_changed(worker)
            raise
        finally:
            self._registry.finish_op(worker)
        return time.perf_counter() - start


def _lane(
    worker: Worker, t: Transfers, direction: str, layer_wise: bool
) -> EngineLane | None:
    """The lane the copy must run on: the host copier's choice; for another
    copier's layer-wise load, the lane of the signal words it writes with
    process_vm_writev."""
    lane_for = getattr(worker.copier, "lane_for", None)
    if lane_for is not None:
        return lane_for(worker.handle, t, direction, layer_wise)
    if layer_wise:
        return getattr(worker.signals, "lane", None)
    return None


@contextlib.asynccontextmanager
async def _lane_turn(
    worker: Worker, lane: EngineLane, deadline: float | None
) -> AsyncIterator[None]:
    """The registration's lane to ourselves, in arrival order; refused at
    once when MAX_WAITING copies already wait, and when the deadline passes
    first (its earlier copy still runs: a stalled engine, most likely)."""
    who = f"{worker.instance_id} rank {worker.tp_rank}"
    if lane.waiting > MAX_WAITING:
        raise Overloaded(
            f"{who}: {lane.waiting} copies already run or wait on this "
            "registration's copy thread; its memory may be stalling the "
            "server's reads"
        )
    if lane.turn is None:
        lane.turn = asyncio.Lock()
    lane.waiting += 1
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if timeout == 0 and not lane.turn.locked():
            raise DeadlineExceeded("deadline: passed before the copy started")
        try:
            await asyncio.wait_for(lane.turn.acquire(), timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline: passed while the copy waited for {who}'s earlier "
                "copy, which still runs (its memory may be stalling the "
                "server's reads)"
            ) from None
        try:
            if worker.closed:  # unregistered (or its process gone) meanwhile
                raise UnknownInstance(
                    f"{who}: unregistered while the copy waited for its "
                    "earlier one; nothing was copied"
                )
            yield
        finally:
            lane.turn.release()
    finally:
        lane.waiting -= 1


def _stream_busy(worker: Worker, direction: str | None) -> bool:
    """A GPU stream with a copy in flight: an inline copy queued behind it
    would hold the loop until both are done (a 640-block load: ~27 ms)."""
    busy = getattr(worker.copier, "busy", None)
    return busy is not None and direction is not None and busy(worker.handle, direction)


def _launch(
    worker: Worker, launch_as: str | None, t: Transfers, deadline: float | None
) -> copy_wait.Launched | None:
    if launch_as is None:
        return None
    launch = getattr(worker.copier, "launch", None)
    return None if launch is None else launch(launch_as, worker.handle, t, deadline)
