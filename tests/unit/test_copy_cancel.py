"""A cancelled Save (its engine died mid-copy) must not release the worker's
memory or the pool slots while the copy thread still runs."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from pegaflow.cache.pool import HostPool
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common.geometry import LayerLayout, Segment, Transfers
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.settings import EngineConfig, PoolConfig
from pegaflow.server.engine import Engine
from tests.unit.stand_in_engine import ENGINE_PID

PAGE = 4096


class BlockingCopier:
    """Host-copier stand-in whose gather blocks until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.events: list[str] = []

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def gather(
        self,
        handle: object,
        t: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        self.started.set()
        self.release.wait(10)
        self.events.append("gather done")

    def scatter(
        self, handle: object, t: Transfers, deadline: float | None = None
    ) -> None:
        raise AssertionError("not used")

    def close(self, handle: object) -> None:
        self.events.append("close")


def test_cancelled_save_waits_for_its_copy() -> None:
    """Scenario: a Save is cancelled while its copy thread runs, then the
    session end unregisters the worker; close comes only after the copy."""
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    copier = BlockingCopier()
    engine = Engine(EngineConfig(inline_copy_bytes=0), pool, {"host": copier})
    layer = LayerLayout(0, 0, 8, PAGE, (Segment(0, PAGE),))
    spec = RegisterSpec(
        "i", "ns", 0, 1, 1, "cpu", "host", ENGINE_PID, ((PAGE, 8 * PAGE),), (layer,)
    )

    async def scenario() -> None:
        init = Caller("unix", ENGINE_PID, 0)  # the engine: a child of ours
        worker = engine.register(spec, init)
        ctx = CallContext(init, worker.owner_token)
        hashes = [bytes([i]) * 32 for i in range(2)]
        save = asyncio.create_task(
            engine.save("i", 0, np.arange(2), hashes, None, 0, ctx)
        )
        while not copier.started.is_set():
            await asyncio.sleep(0.001)
        save.cancel()
        await asyncio.sleep(0.05)
        engine.unregister("i", 0)  # what the session's end does
        assert copier.events == [] and not save.done()
        copier.release.set()
        with pytest.raises(asyncio.CancelledError):
            await save
        assert copier.events == ["gather done", "close"]

    try:
        asyncio.run(scenario())
    finally:
        copier.release.set()
        engine.close()
        pool.close()
