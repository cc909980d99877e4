"""One host-region Engine over a small pool, and a save of two blocks through
it: the shared set-up of tests that watch what a copier is asked to do."""

from __future__ import annotations

import asyncio

import numpy as np

from pegaflow.cache.pool import HostPool
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.settings import EngineConfig, PoolConfig
from pegaflow.server.engine import Engine
from pegaflow.tiers.ssd_link import SsdLink
from tests.unit.stand_in_engine import ENGINE_PID

PAGE = 4096


def host_engine(copier: object, config: EngineConfig | None = None) -> Engine:
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    return Engine(config or EngineConfig(), pool, {"host": copier})  # type: ignore[dict-item]


def ssd_link(engine: Engine, tier: object) -> SsdLink:
    """An SSD link over `tier` for this engine, as the server's assembly makes
    one (not yet added to the engine's tiers)."""
    pool_bytes = engine.pool.size
    return SsdLink(
        tier, engine.store, engine.registry, engine.metrics.ssd, pool_bytes // 2
    )  # type: ignore[arg-type]


def save_two_blocks(engine: Engine, wait_event: int = 0) -> object:
    """Register instance "i" (8 one-page blocks) and save blocks 0 and 1."""
    layer = LayerLayout(0, 0, 8, PAGE, (Segment(0, PAGE),))
    spec = RegisterSpec(
        "i", "ns", 0, 1, 1, "cpu", "host", ENGINE_PID, ((PAGE, 8 * PAGE),), (layer,)
    )

    async def scenario() -> object:
        init = Caller("unix", ENGINE_PID, 0)
        ctx = CallContext(init, engine.register(spec, init).owner_token)
        hashes = [bytes([i]) * 32 for i in range(2)]
        return await engine.save("i", 0, np.arange(2), hashes, None, wait_event, ctx)

    return asyncio.run(scenario())
