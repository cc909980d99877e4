"""A query that waits on the metaserver while its instance unregisters and
registers again with another geometry: nothing found under the old
namespace is leased to the new registration, and a lease of the old one is
refused by a load of the new worker (it would read the slots with the wrong
block layout, into other blocks' bytes)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pegaflow.cache.pool import HostPool
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common.errors import InvalidRequest
from pegaflow.common.geometry import LayerLayout, Segment, Transfers
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.settings import EngineConfig, PoolConfig
from pegaflow.server.engine import Engine
from pegaflow.tiers.protocol import MISS, Lookup, Tier
from tests.unit.stand_in_engine import ENGINE_PID

PAGE = 4096
CALLER = Caller("unix", ENGINE_PID, 0)


class NoCopy:
    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def gather(self, handle, t: Transfers, wait_event=0, deadline=None) -> None:
        pass

    def scatter(self, handle, t: Transfers, deadline=None) -> None:
        raise AssertionError("a load of a foreign lease must not copy")

    def close(self, handle: object) -> None:
        pass


class SlowMetaserver(Tier):
    """A remote tier whose every lookup asks the metaserver (here: waits for
    the test) and learns nothing."""

    medium = "remote"

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    def lookup(self, inst, hashes, start) -> Lookup:
        return Lookup("asking", ask=self._ask)

    async def _ask(self, ns, hashes, start) -> Lookup:
        self.asked.set()
        await self.answer.wait()
        return MISS

    async def close(self) -> None:
        pass


def _spec(page: int, model: str) -> RegisterSpec:
    layer = LayerLayout(0, 0, 8, page, (Segment(0, page),))
    return RegisterSpec("i", model, 0, 1, 1, "cpu", "host", ENGINE_PID,
                        ((page, 8 * page),), (layer,))  # fmt: skip


def test_a_query_across_a_re_registration_leases_nothing_old() -> None:
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    engine = Engine(EngineConfig(), pool, {"host": NoCopy()})
    meta = SlowMetaserver()
    engine.add_tier(meta)
    hashes = [bytes([i]) * 32 for i in range(3)]

    async def scenario() -> None:
        token = engine.register(_spec(PAGE, "model-a"), CALLER).owner_token
        ctx = CallContext(CALLER, token)
        saved = await engine.save("i", 0, np.arange(2), hashes[:2], None, 0, ctx)
        assert saved.stored == 2
        old = engine.query("i", hashes, ctx=ctx)  # block 2 missed: ask peers
        assert old.pending is not None
        waiting = asyncio.ensure_future(old.pending())
        await meta.asked.wait()
        engine.unregister("i", 0, ctx)
        token = engine.register(
            _spec(2 * PAGE, "model-b"), CALLER
        ).owner_token  # new geometry
        meta.answer.set()
        got = await waiting
        assert got.num_blocks == 0 and got.lease_id == 0, got
        # The old namespace's blocks, leased by hand as the race once did:
        ns_old = next(iter(engine.store.entries))[0]
        lease = engine.leases.create(
            "i", ns_old, list(engine.store.entries.values()), 1
        )
        with pytest.raises(InvalidRequest, match="another registration"):
            await engine.load("i", 0, [(lease.id, 0, np.arange(2))], False,
                              0, CallContext(CALLER, token))  # fmt: skip

    asyncio.run(scenario())
    pool.close()
