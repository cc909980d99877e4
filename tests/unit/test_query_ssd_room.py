"""A query whose prefix is partly in L1 and continues on the SSD: finding
room for the SSD blocks must not evict the L1 hits it then leases. Before,
reserve_load evicted them (their write-behind still held the slots, so no
room came of it), the query answered those evicted entries as a lease, and
once the SSD writer released the slots a new save reused them: a load of
the lease would have copied another block's bytes."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np

from pegaflow.cache.pool import HostPool
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.settings import EngineConfig, PoolConfig
from pegaflow.server.engine import Engine
from tests.unit.host_engine import ssd_link
from tests.unit.stand_in_engine import ENGINE_PID
from tests.unit.test_query_reregistered import NoCopy

PAGE = 256 << 10  # the pool below holds 16 blocks
HASHES = [bytes([i]) * 32 for i in range(17)]


class SlowTier:
    """The SSD tier's surface SsdLink uses: write-behind accepted and not yet
    done (its slots held), and the 17th block on the SSD."""

    config = SimpleNamespace(admission="always", write_on="seal")

    def __init__(self) -> None:
        self.releases: list = []

    def spill_many(self, digest, hashes, slots, slot_bytes, release):
        self.releases.append(release)
        return list(range(len(hashes)))

    def queue_room(self) -> int:
        return 1 << 20

    def refuse_many(self, digest, hashes) -> None:
        raise AssertionError("the queue always has room here")

    def lookup(self, digest, hashes) -> int:
        return 1 if hashes and hashes[0] == HASHES[16] else 0

    def load(self, *args) -> Future:
        return Future()


def test_a_query_does_not_lease_hits_it_evicted_for_ssd_room() -> None:
    pool = HostPool(PoolConfig(size_bytes=16 * PAGE, show_progress=False))
    tier = SlowTier()
    # The whole pool leased at once: no share of it kept from one user's leases.
    engine = Engine(EngineConfig(max_leased_share=1.0), pool, {"host": NoCopy()})
    engine.add_tier(ssd_link(engine, tier))
    layer = LayerLayout(0, 0, 32, PAGE, (Segment(0, PAGE),))
    region = ((PAGE, 32 * PAGE),)
    spec = RegisterSpec("i", "m", 0, 1, 1, "cpu", "host", ENGINE_PID, region, (layer,))
    caller = Caller("unix", ENGINE_PID, 0)
    ctx = CallContext(caller, engine.register(spec, caller).owner_token)

    async def scenario() -> None:
        saved = await engine.save("i", 0, np.arange(16), HASHES[:16], None, 0, ctx)
        assert saved.stored == 16  # the pool is full, every block being written
        got = engine.query("i", HASHES, ctx=ctx)
        assert got.lease_id and got.num_blocks == 16
        leased = engine.leases.get(got.lease_id).entries
        assert all(engine.store.entries.get(e.key) is e for e in leased), "evicted"
        for release in tier.releases:  # the writer ends: held slots come back
            release(0, 16)
        await asyncio.sleep(0)
        fresh = [bytes([100 + i]) * 32 for i in range(4)]
        await engine.save("i", 0, np.arange(16, 20), fresh, None, 0, ctx)
        taken = {engine.store.entries[(e.key[0], h)].slots[0] for e in leased[:1]
                 for h in fresh if (e.key[0], h) in engine.store.entries}  # fmt: skip
        assert not taken & {e.slots[0] for e in leased}  # a leased slot reused

    asyncio.run(scenario())
    pool.close()
