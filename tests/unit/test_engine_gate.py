"""The server's copies (pegaflow.server.copy_dispatch) go through the large-request
gate (pegaflow.common.request_limits)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from pegaflow.cache.pool import HostPool
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common.geometry import LayerLayout, Segment, Transfers
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.settings import EngineConfig, PoolConfig
from pegaflow.server.engine import Engine
from tests.unit.stand_in_engine import ENGINE_PID

PAGE = 4096


class CountingCopier:
    """Host-copier stand-in: gathers block until released; counts overlap."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = self.calls = 0

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def gather(
        self,
        handle: object,
        t: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        with self.lock:
            self.running += 1
            self.calls += 1
            self.most = max(self.most, self.running)
        self.release.wait(10)
        with self.lock:
            self.running -= 1

    def scatter(
        self, handle: object, t: Transfers, deadline: float | None = None
    ) -> None:
        raise AssertionError("not used")

    def close(self, handle: object) -> None:
        pass


async def _until(cond: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


def test_large_saves_copy_one_at_a_time() -> None:
    """Scenario: one large-request slot; two saves of 2 blocks (2 descriptors,
    above a threshold of 1). The second waits in the gate while the first
    copies, then copies once the first is done; both store their blocks."""
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    copier = CountingCopier()
    config = EngineConfig(
        inline_copy_bytes=0, max_large_requests=1, large_request_descriptors=1
    )
    engine = Engine(config, pool, {"host": copier})
    layer = LayerLayout(0, 0, 8, PAGE, (Segment(0, PAGE),))
    spec = RegisterSpec(
        "i", "ns", 0, 1, 1, "cpu", "host", ENGINE_PID, ((PAGE, 8 * PAGE),), (layer,)
    )

    async def scenario() -> None:
        init = Caller("unix", ENGINE_PID, 0)  # the engine: a child of ours
        ctx = CallContext(init, engine.register(spec, init).owner_token)
        ids = np.arange(2)
        first = asyncio.create_task(
            engine.save("i", 0, ids, [b"a" * 32, b"b" * 32], None, 0, ctx)
        )
        await _until(lambda: copier.calls == 1)
        second = asyncio.create_task(
            engine.save("i", 0, ids, [b"c" * 32, b"d" * 32], None, 0, ctx)
        )
        await _until(lambda: engine.gate.waiting == 1)
        assert copier.calls == 1  # the second has not started its copy
        copier.release.set()
        results = await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert [r.stored for r in results] == [2, 2]

    try:
        asyncio.run(scenario())
    finally:
        copier.release.set()
        engine.close()
        pool.close()
    assert copier.calls == 2 and copier.most == 1
