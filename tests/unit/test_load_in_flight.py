"""Loads answered in flight (Engine.load's done_event), in process: a copier
that launches stands in for the CUDA one, its batches done when the test says.
A launched load is answered as soon as it is queued, its blocks still pinned,
the engine's event recorded after it; what follows the copy (unpins, the
lease, the accounting) runs once it is done. A copy that is not launched, an
event that cannot be recorded and a bad index are answered as before. The real
bytes move on a GPU: tests/gpu/test_gpu_server.py."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.cache.pool import HostPool
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common.errors import CopyFailed, InvalidRequest
from pegaflow.common.geometry import LayerLayout, Segment, Transfers
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.settings import EngineConfig, PoolConfig
from pegaflow.server.engine import Engine
from tests.unit.stand_in_engine import ENGINE_PID

PAGE = 4096
HASHES = [bytes([i]) * 32 for i in range(4)]
EVENTS = 8  # the worker's registered events


class LaunchingCopier:
    """The CUDA copier's launch surface over no GPU: a batch is done once
    `done` is set (or fails with `fail`)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.fail: Exception | None = None
        self.record_error: Exception | None = None
        self.log: list = []
        self.launches = True

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def close(self, handle: object) -> None:
        pass

    def gather(self, handle, t: Transfers, wait_event=0, deadline=None) -> None:
        pass

    def scatter(self, handle, t: Transfers, deadline=None) -> None:
        self.log.append("copied on a thread")

    def busy(self, handle, direction: str) -> bool:
        return True  # never inline: launched (or on a thread)

    def launch(self, direction, handle, t: Transfers, deadline=None):
        if not self.launches:
            return None
        self.log.append("launched")
        return SimpleNamespace(expected_end=time.perf_counter() + 0.002)

    def launched_done(self, launched) -> bool:
        if self.fail is not None and self.done.is_set():
            raise self.fail
        return self.done.is_set()

    def wait_launched(self, launched) -> None:
        assert self.done.wait(10)
        if self.fail is not None:
            raise self.fail

    def finish_launched(self, launched, failed: bool = False) -> None:
        self.log.append("finished" if not failed else "finished, failed")

    def check_event(self, handle, index: int, field: str) -> None:
        if not 1 <= index <= EVENTS:
            raise InvalidRequest(f"{field}: {index}, the worker registered {EVENTS}")

    def record_done(self, handle, done_event: int) -> None:
        if self.record_error is not None:
            raise self.record_error
        self.log.append(("recorded", done_event))


@pytest.fixture
def setup():
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    copier = LaunchingCopier()
    # Copies this small would run inline: never in flight (see the last test).
    engine = Engine(EngineConfig(inline_copy_bytes=4096), pool, {"host": copier})
    layer = LayerLayout(0, 0, 64, PAGE, (Segment(0, PAGE),))
    region = ((PAGE, 64 * PAGE),)
    spec = RegisterSpec("i", "m", 0, 1, 1, "cpu", "host", ENGINE_PID, region, (layer,))
    caller = Caller("unix", ENGINE_PID, 0)
    ctx = CallContext(caller, engine.register(spec, caller).owner_token)
    copier.done.set()  # the save's copy
    asyncio.run(engine.save("i", 0, np.arange(4), HASHES, None, 0, ctx))
    copier.done.clear()
    copier.log.clear()
    yield engine, ctx, copier
    engine.close()
    pool.close()


def lease_of(engine: Engine, ctx: CallContext):
    return engine.leases.get(engine.query("i", HASHES, ctx=ctx).lease_id)


def test_a_launched_load_is_answered_in_flight_and_finished_after(setup) -> None:
    engine, ctx, copier = setup
    lease = lease_of(engine, ctx)
    entries = list(lease.entries)

    async def scenario() -> None:
        call = engine.load("i", 0, [(lease.id, 0, np.arange(20, 24))], False, 0,
                           ctx, done_event=5)  # fmt: skip
        got = await asyncio.wait_for(call, 5)  # the copy is not done
        assert (got.loaded, got.bytes, got.in_flight) == (4, 4 * PAGE, True)
        assert copier.log == ["launched", ("recorded", 5)]
        assert [e.pins for e in entries] == [1] * 4  # held until it lands
        assert lease.id in engine.leases  # consumed once it landed
        copier.done.set()
        while engine._loads_in_flight:
            await asyncio.sleep(0.001)
        assert copier.log[-1] == "finished"
        assert [e.pins for e in entries] == [0] * 4
        assert lease.id not in engine.leases

    asyncio.run(scenario())


@pytest.mark.parametrize("why", ["not launched", "not recorded", "no event"])
def test_a_load_that_cannot_be_in_flight_is_answered_done(setup, why: str) -> None:
    engine, ctx, copier = setup
    copier.launches = why != "not launched"
    if why == "not recorded":
        copier.record_error = CopyFailed("cudaEventRecord: stand-in failure")
    copier.done.set()
    lease = lease_of(engine, ctx)
    done_event = 0 if why == "no event" else 3
    got = asyncio.run(
        engine.load("i", 0, [(lease.id, 0, np.arange(20, 24))], False, 0, ctx,
                    done_event=done_event)
    )  # fmt: skip
    assert (got.loaded, got.in_flight) == (4, False)
    assert all(e.pins == 0 for e in lease.entries)
    assert copier.log[0] == (
        "copied on a thread" if why == "not launched" else "launched"
    )
    assert not any(isinstance(x, tuple) for x in copier.log)  # nothing recorded


def test_a_bad_done_event_is_refused_before_anything_moves(setup) -> None:
    engine, ctx, copier = setup
    lease = lease_of(engine, ctx)
    with pytest.raises(InvalidRequest, match="done_event: 99"):
        asyncio.run(
            engine.load("i", 0, [(lease.id, 0, np.arange(20, 24))], False, 0, ctx,
                        done_event=99)
        )  # fmt: skip
    assert copier.log == [] and all(e.pins == 0 for e in lease.entries)
    assert lease.id in engine.leases  # still there: the engine may load it


@pytest.mark.parametrize("fails", [True, False])
def test_a_copy_failing_after_its_answer_hangs_up_and_releases_its_blocks(
    setup, fails: bool
) -> None:
    """The engine's event is never recorded past the failed copy (the stream
    faulted): the server ends the caller's connection (`hang_up`), which the
    engine's wait watches, logs it, and the blocks go back. A copy that
    lands hangs up nothing."""
    engine, ctx, copier = setup
    lease = lease_of(engine, ctx)
    hung_up: list[bool] = []
    hang_up = functools.partial(hung_up.append, True)

    async def scenario() -> None:
        call = engine.load("i", 0, [(lease.id, 0, np.arange(20, 24))], False, 0,
                           ctx, done_event=1, hang_up=hang_up)  # fmt: skip
        got = await asyncio.wait_for(call, 5)
        assert got.in_flight and not hung_up
        if fails:
            copier.fail = CopyFailed("an illegal address, stand-in")
        copier.done.set()
        while engine._loads_in_flight:
            await asyncio.sleep(0.001)

    asyncio.run(scenario())
    assert ("finished, failed" in copier.log) == fails
    assert hung_up == ([True] if fails else [])
    counted = engine.metrics.registry.get_sample_value
    name = "pegaflow_loads_in_flight_total"
    assert counted(name, {"outcome": "answered"}) == 1
    assert counted(name, {"outcome": "failed"}) == (1 if fails else 0)
    assert all(e.pins == 0 for e in lease.entries)


def test_a_load_small_enough_to_run_inline_is_answered_done(setup) -> None:
    """It is never launched, and the in-flight machinery (a task, a future)
    would cost a 1-block load ~0.1 ms."""
    engine, ctx, copier = setup
    engine.config = dataclasses.replace(engine.config, inline_copy_bytes=4 * PAGE)
    copier.done.set()
    lease = lease_of(engine, ctx)
    got = asyncio.run(
        engine.load("i", 0, [(lease.id, 0, np.arange(20, 24))], False, 0, ctx,
                    done_event=3)
    )  # fmt: skip
    assert (got.loaded, got.in_flight) == (4, False)
    assert copier.log == ["launched", "finished"]  # answered done: nothing recorded
