"""A host registration's own copy lane (pegaflow.copiers.engine_lane) and how
the dispatcher queues copies on it (pegaflow.server.copy_dispatch): a stalled
copy holds its own lane only, a bounded number of copies wait behind it, and
each waits no longer than its deadline. The stall here is an Event a copy
waits on; tests/server/test_stalled_engine.py stalls a real process_vm copy."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.common.errors import DeadlineExceeded, Overloaded, UnknownInstance
from pegaflow.common.geometry import Transfers
from pegaflow.copiers.engine_lane import MAX_WAITING, EngineLane, Threads
from pegaflow.copiers.host_copier import HostCopyEngine, HostRegions
from pegaflow.server.copy_dispatch import _lane_turn

WORKER = SimpleNamespace(instance_id="stalls", tp_rank=0, closed=False)


def test_threads_run_in_order_and_report_errors() -> None:
    pool = Threads(1, "t")
    seen: list[int] = []
    futures = [pool.submit(seen.append, i) for i in range(50)]
    for f in futures:
        f.result(5)
    assert seen == list(range(50))
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    assert not pool.owns_current_thread()
    assert pool.submit(pool.owns_current_thread).result(5)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(print)


def test_a_stalled_lane_holds_only_its_own_threads() -> None:
    """Its runner waits for good; another lane's copies go on, and closing
    the stalled lane returns at once (its daemon thread may stay stuck)."""
    release = threading.Event()
    stuck, other = EngineLane("a", 1), EngineLane("b", 1)
    stuck.runner.submit(release.wait)
    queued = stuck.runner.submit(lambda: "late")
    assert other.runner.submit(lambda: "served").result(5) == "served"
    assert not queued.done()
    start = time.monotonic()
    stuck.close()
    other.close()
    assert time.monotonic() - start < 1
    release.set()
    assert queued.result(5) == "late"  # queued before close: still run


def test_copies_wait_their_turn_in_order() -> None:
    async def main() -> list[int]:
        lane = EngineLane("a", 0)
        order: list[int] = []

        async def copy(i: int) -> None:
            async with _lane_turn(WORKER, lane, None):
                order.append(i)
                await asyncio.sleep(0.001)

        await asyncio.gather(*(copy(i) for i in range(MAX_WAITING)))
        assert lane.waiting == 0
        return order

    assert asyncio.run(main()) == list(range(MAX_WAITING))


def test_behind_a_stalled_copy_a_deadline_ends_the_wait_and_the_queue_is_bounded() -> (
    None
):
    async def main() -> None:
        lane = EngineLane("a", 0)
        stall = asyncio.Event()

        async def stalled() -> None:
            async with _lane_turn(WORKER, lane, None):
                await stall.wait()

        first = asyncio.create_task(stalled())
        await asyncio.sleep(0)
        with pytest.raises(DeadlineExceeded, match="stalls rank 0's earlier copy"):
            async with _lane_turn(WORKER, lane, time.monotonic() + 0.05):
                pytest.fail("ran while the earlier copy held the lane")
        waiters = [asyncio.create_task(stalled()) for _ in range(MAX_WAITING)]
        await asyncio.sleep(0)
        assert lane.waiting == MAX_WAITING + 1
        with pytest.raises(Overloaded, match="stalls rank 0: 9 copies already"):
            async with _lane_turn(WORKER, lane, None):
                pass
        stall.set()
        await asyncio.gather(first, *waiters)
        assert lane.waiting == 0 and not lane.turn.locked()

    asyncio.run(main())


def _regions(shared_inside: bool | None, signals_in_kv: bool = False) -> HostRegions:
    """A registration of [0x10000, 0x20000); shared_inside: None (no memfd),
    True (a memfd over all of it) or False (over its first half only)."""
    regions = HostRegions(1, (0x10000,), (0x10000,))
    if shared_inside is not None:
        end = 0x20000 if shared_inside else 0x18000
        starts, ends = np.array([0x10000], np.uint64), np.array([end], np.uint64)

        def translate(remote: np.ndarray, n: np.ndarray) -> tuple:
            inside = (remote >= starts[0]) & (remote + n <= ends[0])
            return remote, inside

        regions.shared.kv = SimpleNamespace(translate=translate)
        regions.shared.signals_in_kv = signals_in_kv
    return regions


def _table(engine_addresses: list[int], direction: str) -> Transfers:
    engine = np.array(engine_addresses, np.uint64)
    pool = np.arange(len(engine), dtype=np.uint64) * np.uint64(4096)
    n = np.full(len(engine), 4096, np.uint64)
    return (
        Transfers(engine, pool, n)
        if direction == "save"
        else Transfers(pool, engine, n)
    )


def test_copies_queued_behind_a_stall_end_with_their_registration() -> None:
    """Copies waiting for a stalled one's turn copy nothing once their
    registration ended meanwhile; a deadline already past when the lane is
    free says so (not that an earlier copy still runs)."""

    async def main() -> None:
        worker = SimpleNamespace(instance_id="gone", tp_rank=0, closed=False)
        lane, stall = EngineLane("a", 0), asyncio.Event()

        async def stalled() -> None:
            async with _lane_turn(worker, lane, None):
                await stall.wait()

        async def queued() -> None:
            async with _lane_turn(worker, lane, None):
                pytest.fail("copied for a registration that ended")

        first = asyncio.create_task(stalled())
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(queued()) for _ in range(3)]
        await asyncio.sleep(0)
        worker.closed = True  # unregistered while they wait
        stall.set()
        await first
        for waiter in waiters:
            with pytest.raises(UnknownInstance, match="gone rank 0: unregistered"):
                await waiter
        assert lane.waiting == 0 and not lane.turn.locked()
        with pytest.raises(DeadlineExceeded, match="passed before the copy started"):
            async with _lane_turn(WORKER, lane, time.monotonic() - 1):
                pytest.fail("started after its deadline")
        lane.close()

    asyncio.run(main())


@pytest.mark.parametrize("direction", ["save", "load"])
def test_which_host_copies_take_the_lane(direction: str) -> None:
    """Every copy that may call process_vm_* takes the lane; a copy all in
    the shared memfd (memcpy in the server's own mapping) does not."""
    lane_for = HostCopyEngine.lane_for
    low, high = [0x10000, 0x11000], [0x10000, 0x19000]
    plain = _regions(None)
    assert lane_for(plain, _table(low, direction), direction, False) is plain.lane
    whole = _regions(True)
    assert lane_for(whole, _table(high, direction), direction, False) is None
    half = _regions(False)
    assert lane_for(half, _table(low, direction), direction, False) is None
    assert lane_for(half, _table(high, direction), direction, False) is half.lane
    # layer by layer, the signal words too: through the memfd, or by process_vm
    assert lane_for(whole, _table(low, direction), direction, True) is whole.lane
    signals = _regions(True, signals_in_kv=True)
    assert lane_for(signals, _table(low, direction), direction, True) is None


def test_a_copy_outlives_every_cancel_of_its_rpc_until_the_server_stops() -> None:
    """A cancelled RPC still waits for its copy on the lane before it gives
    back the turn and the worker's active_ops (which let close unmap the
    memory the copy uses), however often it is cancelled; once the server
    stops, a repeated cancel ends the wait, so a stalled copy cannot hold
    the exit."""
    from pegaflow.common.request_limits import LargeRequestGate
    from pegaflow.server import copy_dispatch
    from pegaflow.server.copy_dispatch import CopyDispatch

    lane = EngineLane("a", 0)
    ops_when_returned: list[tuple[int, bool]] = []

    class Registry:
        def finish_op(self, worker: SimpleNamespace) -> None:
            worker.active_ops -= 1

        def is_current(self, worker: SimpleNamespace) -> bool:
            return True

    waits = SimpleNamespace(labels=lambda way: SimpleNamespace(inc=lambda: None))
    metrics = SimpleNamespace(copy_waits=waits)
    copier = SimpleNamespace(lane_for=lambda *args: lane)
    worker = SimpleNamespace(
        active_ops=0,
        copier=copier,
        handle=None,
        instance_id="i",
        tp_rank=0,
        closed=False,
    )
    t = _table([0x10000], "save")

    async def cancelled_twice(stop_first: bool) -> bool:
        started, release = threading.Event(), threading.Event()

        def copy(handle: object, t: Transfers) -> None:
            started.set()
            release.wait(10)

        dispatch = CopyDispatch(
            Registry(), LargeRequestGate(1, 10), 0, metrics, lambda w: None
        )
        task = asyncio.create_task(dispatch.run(worker, copy, t, direction="save"))
        while not started.is_set():
            await asyncio.sleep(0.005)
        if stop_first:
            copy_dispatch.stopping()
        for _ in range(2):  # the RPC's cancel, then another (shutdown's)
            task.cancel()
            await asyncio.sleep(0.02)
        ended_early = task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        ops_when_returned.append((worker.active_ops, lane.turn.locked()))
        return ended_early

    assert asyncio.run(cancelled_twice(stop_first=False)) is False
    assert ops_when_returned == [(0, False)]
    assert asyncio.run(cancelled_twice(stop_first=True)) is True
    lane.close()
