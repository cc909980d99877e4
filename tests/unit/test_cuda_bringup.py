"""The GPU half of a start beside a serving server (pegaflow.server.cuda_bringup):
its steps' order, what a CUDA engine's registration waits for, and a failure
kept and named. The steps are plain functions here; the real ones (pinning,
numba-cuda, the copy engine) run in the gpu-marked server tests."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pegaflow.common.errors import DeviceBroken
from pegaflow.server.cuda_bringup import CudaBringUp

WAIT_S = 30.0


class Steps:
    """pin and warm each block until released; build returns a marker."""

    def __init__(self, fail: str = "") -> None:
        self.pin_started = threading.Event()
        self.warm_started = threading.Event()
        self.release = threading.Event()
        self.installed: list[object] = []
        self.install_thread: list[threading.Thread] = []
        self.fail = fail
        self.built = object()

    def pin(self) -> None:
        self.pin_started.set()
        assert self.release.wait(WAIT_S)
        if self.fail == "pin":
            raise OSError("cudaHostRegister: cudaErrorInvalidValue")

    def warm(self) -> None:
        self.warm_started.set()
        assert self.release.wait(WAIT_S)

    def build(self) -> object:
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
        for started in (steps.pin_started, steps.warm_started):
            assert await asyncio.to_thread(started.wait, WAIT_S)
        await asyncio.sleep(0.05)
        assert not waiting.done() and bringup.state() == "starting"
        assert bringup.engine() is None and bringup.faults == {}
        steps.release.set()
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
    steps = Steps(fail="pin")
    steps.release.set()

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
        steps.release.set()
        await asyncio.wait_for(bringup.ready(), WAIT_S)
        assert steps.installed == [steps.built]

    asyncio.run(scenario())


def test_run_now_builds_on_the_calling_thread_or_raises() -> None:
    """The start that needs the engine before serving (the SSD tier's direct
    route) gets it, or the cause to fail the start with."""
    ok = Steps()
    ok.release.set()
    assert ok.bringup().run_now() is ok.built
    assert ok.install_thread == [threading.current_thread()]
    bad = Steps(fail="pin")
    bad.release.set()
    with pytest.raises(OSError, match="cudaErrorInvalidValue"):
        bad.bringup().run_now()
    assert bad.installed == []
