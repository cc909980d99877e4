"""The GPU half of a start beside a serving server (pegaflow.server.cuda_bringup):
its steps' order, what a CUDA engine's registration waits for (the pool's
first chunk pinned and the kernel compiled, not the whole pool), and a
failure kept and named. Warm-up and build are plain functions and the
registrar a stand-in (tests/unit/test_pin_chunks.py); the real ones (pinning,
numba-cuda, the copy engine) run in the gpu-marked server tests."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.cache.pin_chunks import ChunkPins
from pegaflow.common.cuda_driver import CudaError
from pegaflow.common.errors import DeviceBroken
from pegaflow.server.cuda_bringup import CudaBringUp
from tests.unit.test_pin_chunks import CHUNK, FakeRegistrar

WAIT_S = 30.0


class Steps:
    """The pool's chunk 0 and warm each block until released (pinning any
    chunk listed in `held` too); build returns a marker, noting the pins."""

    def __init__(
        self, fail: int | None = None, held: tuple[int, ...] = (), hold: bool = False
    ) -> None:
        """hold: pins held as the server's start makes them (ChunkPins hold)."""
        self.registrar = FakeRegistrar(held=(0, *held), fail=fail)
        self.hold = hold
        self.warm_started = threading.Event()
        self.released = threading.Event()
        self.installed: list[object] = []
        self.install_thread: list[threading.Thread] = []
        self.built = SimpleNamespace(faults={}, mapped_allocations=0)
        self.pins: ChunkPins | None = None
        self.pinned_at_build: list[int] = []

    def release(self) -> None:
        self.released.set()
        self.registrar.release(0)

    def pin(self) -> ChunkPins:
        self.pins = ChunkPins(
            self.registrar.base, 8 * CHUNK, self.registrar, hold=self.hold
        )
        self.pins.start()
        return self.pins

    def warm(self) -> None:
        self.warm_started.set()
        assert self.released.wait(WAIT_S)

    def build(self, pins: ChunkPins) -> object:
        self.pinned_at_build = pins.pinned.nonzero()[0].tolist()
        return self.built

    def install(self, engine: object) -> None:
        self.installed.append(engine)
        self.install_thread.append(threading.current_thread())

    def bringup(self) -> CudaBringUp:
        return CudaBringUp(3, self.pin, self.warm, self.build, self.install)


def test_pinning_and_compiling_overlap_and_registration_waits_for_both() -> None:
    """Pin and warm-up run at once (each waits for a release that comes only
    after both started); ready() returns only after the engine was built and
    installed on the event loop's thread."""
    steps = Steps()

    async def scenario() -> None:
        bringup = steps.bringup()
        bringup.start(asyncio.get_running_loop())
        waiting = asyncio.create_task(bringup.ready())
        await asyncio.to_thread(steps.registrar.wait_started, 0)
        assert await asyncio.to_thread(steps.warm_started.wait, WAIT_S)
        await asyncio.sleep(0.05)
        assert not waiting.done() and bringup.state() == "starting"
        assert bringup.engine() is None and bringup.faults == {}
        steps.release()
        await asyncio.wait_for(waiting, WAIT_S)
        assert steps.installed == [steps.built]
        assert steps.install_thread == [threading.current_thread()]
        assert bringup.engine() is steps.built and bringup.state() == "ready"
        bringup.join(WAIT_S)

    asyncio.run(scenario())


def test_a_failed_bringup_is_named_to_engines_and_health() -> None:
    """A pool that cannot be pinned: nothing installed; every later CUDA
    registration gets DeviceBroken (UNAVAILABLE) naming the cause and the
    fix; /health's faults name the first GPU."""
    steps = Steps(fail=0)
    steps.release()

    async def scenario() -> None:
        bringup = steps.bringup()
        bringup.start(asyncio.get_running_loop())
        for _ in range(2):  # kept: asked again, the same answer
            with pytest.raises(DeviceBroken, match="cudaErrorInvalidValue") as info:
                await asyncio.wait_for(bringup.ready(), WAIT_S)
            assert "--devices none" in str(info.value)
        assert steps.installed == []
        assert bringup.state().startswith("failed: ")
        assert list(bringup.faults) == [3]
        assert "cudaErrorInvalidValue" in bringup.faults[3]
        bringup.join(WAIT_S)

    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_the_bringup_running() -> None:
    """An RPC whose deadline passes cancels its wait, not the bring-up: a
    later registration still gets the engine."""
    steps = Steps()

    async def scenario() -> None:
        bringup = steps.bringup()
        bringup.start(asyncio.get_running_loop())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(bringup.ready(), 0.05)
        steps.release()
        await asyncio.wait_for(bringup.ready(), WAIT_S)
        assert steps.installed == [steps.built]

    asyncio.run(scenario())


def test_run_now_builds_on_the_calling_thread_or_raises() -> None:
    """The start that needs the engine before serving (the SSD tier's direct
    route) gets it, every chunk pinned first, or the cause to fail the
    start with."""
    ok = Steps()
    ok.release()
    assert ok.bringup().run_now() is ok.built
    assert ok.install_thread == [threading.current_thread()]
    assert ok.pinned_at_build == list(range(8))  # every chunk before it serves
    bad = Steps(fail=5)
    bad.release()
    with pytest.raises(CudaError, match="cudaErrorInvalidValue"):
        bad.bringup().run_now()
    assert bad.installed == []


def test_a_cuda_engine_registers_before_the_whole_pool_is_pinned(caplog) -> None:
    """The copy engine is built once the kernel compiled and the pool's first
    chunk is pinned (what its construction reads), not the whole pool: with
    chunk 1 still pinning, a CUDA registration is let in; /health shows the
    progress, and the log says when every chunk is pinned and how long it
    took."""
    caplog.set_level("INFO", "pegaflow.cache.pin_chunks")
    steps = Steps(held=(1,))

    async def scenario() -> None:
        bringup = steps.bringup()
        assert bringup.pinning() is None
        bringup.start(asyncio.get_running_loop())
        steps.release()
        await asyncio.wait_for(bringup.ready(), WAIT_S)
        assert steps.pinned_at_build == [0] and bringup.state() == "ready"
        progress = bringup.pinning()
        assert progress == {"chunks_pinned": 1, "chunks": 8, "seconds": None,
                            "failed": None}  # fmt: skip
        steps.registrar.release(1)
        await asyncio.to_thread(steps.pins.wait_all)
        progress = bringup.pinning()
        assert progress["chunks_pinned"] == 8 and progress["seconds"] is not None
        bringup.join(WAIT_S)

    asyncio.run(scenario())
    assert any("pool pinned for the GPUs: 8 chunk(s)" in r.message
               for r in caplog.records)  # fmt: skip


def test_a_chunk_failing_after_the_start_is_named_to_engines_and_health() -> None:
    """Chunk 1 refused after the copy engine was installed: it stays (copies
    of chunk 0 go on), but registrations from then on get DeviceBroken
    naming the cause, and /health says failed, with the fault and the
    pinning's failure."""
    steps = Steps(held=(1,), fail=1)

    async def scenario() -> None:
        bringup = steps.bringup()
        bringup.start(asyncio.get_running_loop())
        steps.release()
        await asyncio.wait_for(bringup.ready(), WAIT_S)
        assert bringup.faults == {}
        steps.registrar.release(1)
        with pytest.raises(DeviceBroken, match="cudaErrorInvalidValue"):
            await asyncio.to_thread(steps.pins.wait_all)
        with pytest.raises(DeviceBroken, match="cudaErrorInvalidValue"):
            await asyncio.wait_for(bringup.ready(), WAIT_S)
        assert bringup.engine() is steps.built
        assert bringup.state().startswith("failed: ")
        assert "cudaErrorInvalidValue" in bringup.faults[3]
        assert "cudaErrorInvalidValue" in str(bringup.pinning()["failed"])
        bringup.join(WAIT_S)

    asyncio.run(scenario())


def test_a_stop_mid_pinning_pins_no_more() -> None:
    """join() (the stop, before the pool unpins) lets the chunk being pinned
    finish and pins nothing after it."""
    steps = Steps(held=(1,))

    async def scenario() -> None:
        bringup = steps.bringup()
        bringup.start(asyncio.get_running_loop())
        steps.release()
        await asyncio.wait_for(bringup.ready(), WAIT_S)
        steps.registrar.wait_started(1)
        joining = asyncio.create_task(asyncio.to_thread(bringup.join, WAIT_S))
        await asyncio.sleep(0.05)
        assert not joining.done()  # chunk 1 is being registered
        steps.registrar.release(1)
        await asyncio.wait_for(joining, WAIT_S)
        assert steps.registrar.registered == [0, 1]
        await asyncio.sleep(0.05)
        assert steps.registrar.started == [0, 1]

    asyncio.run(scenario())


def test_the_copy_engine_is_built_before_the_rest_of_the_pool_pins() -> None:
    """Only the chunks the start asked for are pinned until the copy engine
    is built: its driver calls queued behind the other chunks'
    cudaHostRegister (a GPU engine registered 3-4 s after the host engine's
    first hit at 48 GiB, H200). The rest pin right after."""
    steps = Steps(hold=True)
    seen: list[list[int]] = []

    def build(pins: ChunkPins) -> object:
        with steps.registrar.began:  # a pinning thread let go would start at once
            steps.registrar.began.wait_for(lambda: 1 in steps.registrar.started, 0.5)
            seen.append(list(steps.registrar.started))
        return steps.built

    steps.build = build  # type: ignore[method-assign]

    async def scenario() -> None:
        bringup = steps.bringup()
        bringup.start(asyncio.get_running_loop())
        steps.release()
        await asyncio.wait_for(bringup.ready(), WAIT_S)
        await asyncio.to_thread(steps.pins.wait_all)
        bringup.join(WAIT_S)

    asyncio.run(scenario())
    assert seen == [[0]], f"chunks started before the build: {seen}"
    assert sorted(steps.registrar.registered) == list(range(8))


async def _held_and_ready(steps: Steps) -> CudaBringUp:
    """A bring-up holding the bulk pinning (as a restart's does), built."""
    bringup = steps.bringup()
    bringup.hold_pins_until_released()
    bringup.start(asyncio.get_running_loop())
    steps.release()
    await asyncio.wait_for(bringup.ready(), WAIT_S)
    return bringup


def test_a_restart_holds_the_rest_of_the_pool_until_its_check_is_done() -> None:
    """hold_pins_until_released: after the build only the chunks copies ask
    for pin (a restart's check reads the pool meanwhile: beside the bulk
    pinning, its first hit and a GPU registration waited for the whole pool);
    release_pins lets the rest pin."""
    steps = Steps(hold=True)

    async def scenario() -> None:
        bringup = await _held_and_ready(steps)
        with steps.registrar.began:
            steps.registrar.began.wait_for(lambda: 1 in steps.registrar.started, 0.5)
        assert steps.registrar.started == [0]
        asked = np.array([5])
        await asyncio.to_thread(steps.pins.wait, asked, None, "a copy")
        assert sorted(steps.registrar.started) == [0, 5]  # asked for: pinned
        bringup.release_pins()
        await asyncio.to_thread(steps.pins.wait_all)
        bringup.join(WAIT_S)

    asyncio.run(scenario())
    assert sorted(steps.registrar.registered) == list(range(8))


def test_a_stop_while_pins_are_held_ends_the_bringup() -> None:
    """join() lets a bring-up thread waiting on held pins end."""
    steps = Steps(hold=True)

    async def scenario() -> None:
        bringup = await _held_and_ready(steps)
        bringup.join(WAIT_S)
        assert not bringup._thread.is_alive()

    asyncio.run(scenario())
