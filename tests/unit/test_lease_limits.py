"""Leases a client can make pile up only so far: an instance holds at most
so many leases and leased blocks (a query past that is refused, RESOURCE_
EXHAUSTED, naming the instance and the fix), releasing makes room again,
and a query repeating one cached hash leases that block once."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from pegaflow.cache import leases
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.leases import LeaseTable, TooManyLeases
from pegaflow.cache.pool import HostPool
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.common.identity import UNKNOWN, CallContext, Caller
from pegaflow.common.keys import Namespace
from pegaflow.common.settings import EngineConfig, PoolConfig
from pegaflow.server.engine import Engine
from tests.unit.stand_in_engine import ENGINE_PID
from tests.unit.test_query_reregistered import NoCopy

SLOT = 4096


def _ready_store(n: int) -> tuple[BlockStore, list]:
    store = BlockStore(SlabAllocator(1 << 30, 64 * SLOT, SLOT), LRUPolicy())
    ns = Namespace("m", 1, 1, 1, SLOT, (1, SLOT))
    hashes = [bytes([i]) * 32 for i in range(n)]
    store.finish_save(store.reserve_save(ns, 0, hashes, np.arange(1)), True)
    return store, store.longest_prefix(ns, hashes)


def test_an_instance_holds_a_bounded_number_of_leases(monkeypatch) -> None:
    monkeypatch.setattr(leases, "MAX_LEASES_PER_INSTANCE", 3)
    store, entries = _ready_store(2)
    table = LeaseTable(store, 30.0)
    made = [table.create("a", 1, entries, 1) for _ in range(3)]
    with pytest.raises(TooManyLeases, match="instance_id: 'a' holds 3 leases") as err:
        table.create("a", 1, entries, 1)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    table.create("b", 1, entries, 1)  # another instance has its own budget
    table.release(made[0].id)
    table.create("a", 1, entries, 1)
    assert len(table) == 4


def test_an_instance_holds_a_bounded_number_of_leased_blocks(monkeypatch) -> None:
    monkeypatch.setattr(leases, "MAX_LEASED_BLOCKS_PER_INSTANCE", 5)
    store, entries = _ready_store(2)
    table = LeaseTable(store, 30.0)
    first = table.create("a", 1, entries, 1)
    table.create("a", 1, entries, 1)
    with pytest.raises(TooManyLeases, match="of 4 blocks"):
        table.create("a", 1, entries, 1)
    table.release(first.id)
    table.create("a", 1, entries[:1], 1)
    assert table.sweep(now=1e18) == 2 and len(table) == 0


def test_each_user_leases_its_own_share_of_the_pool() -> None:
    """Room is counted per owner uid (remote engines, of unknown uid, as one
    user), in bytes over every shard, and comes back when a lease ends."""
    store, entries = _ready_store(2)
    table = LeaseTable(store, 30.0, max_leased_bytes=5 * SLOT)
    assert table.room(1000, 2 * SLOT, 4) == 2
    first = table.create("a", 1, entries, 1, user=1000, block_bytes=2 * SLOT)
    assert table.room(1000, 2 * SLOT, 4) == 0  # 1 block's bytes left: too few
    assert table.room(1000, SLOT, 4) == 1
    table.release(first.id)
    assert table.room(1000, 2 * SLOT, 4) == 2
    assert LeaseTable(store, 30.0).room(1000, 1 << 40, 7) == 7  # no bound given


def test_users_holding_leases_share_the_bound_equally() -> None:
    """Two users each leasing the whole bound would lease the whole pool
    between them, and no save could evict: each user holding leases gets
    an equal part of it, remote engines (unknown uid) together one part."""
    store, entries = _ready_store(1)
    table = LeaseTable(store, 30.0, max_leased_bytes=12 * SLOT)
    a = table.create("a", 1, entries, 1, user=1000, block_bytes=8 * SLOT)
    assert table.room(1001, SLOT, 12) == 6  # a newcomer: half of the bound
    b = table.create("b", 1, entries, 1, user=1001, block_bytes=6 * SLOT)
    assert table.room(1000, SLOT, 12) == 0  # past its half: nothing more
    assert table.room(UNKNOWN, SLOT, 12) == 4  # a third user: a third
    assert table.room(1001, SLOT, 12) == 0
    table.release(a.id)  # 1000 holds nothing now: no part of the bound
    assert table.room(1001, SLOT, 12) == 6
    assert table.room(1000, SLOT, 12) == 6  # a newcomer again: the other half
    table.release(b.id)
    assert table.room(1000, SLOT, 12) == 12
    table.create("c", 1, entries, 1, user=1002)  # no block_bytes: no part
    assert table.room(1000, SLOT, 12) == 12


def test_the_sweep_stops_at_the_first_live_lease() -> None:
    """The sweep runs every second: it passed over every lease (65,536 an
    instance may hold). Leases expire in the order they were made, so it
    looks at the expired ones and the first live one only."""
    store, entries = _ready_store(2)
    table = LeaseTable(store, 30.0)
    made = [table.create("a", 1, entries, 1) for _ in range(200)]
    assert all(a.expires <= b.expires for a, b in zip(made, made[1:], strict=False))
    looked: list[int] = []

    class Counted(dict):
        def __getitem__(self, lid: int) -> object:
            looked.append(lid)
            return dict.__getitem__(self, lid)

        def items(self) -> None:  # type: ignore[override]
            raise AssertionError("a pass over every lease")

        values = items

    table._leases = Counted(table._leases)
    later = (i for i, m in enumerate(made) if m.expires > made[4].expires)
    cut = next(later, len(made)) - 1  # the last lease expiring with the fifth
    assert table.sweep(now=made[4].expires) == cut + 1
    assert len(looked) <= cut + 2 and len(table) == 199 - cut
    assert table.sweep(now=made[-1].expires) == 199 - cut and len(table) == 0


def test_a_query_repeating_a_cached_hash_leases_it_once() -> None:
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    engine = Engine(EngineConfig(), pool, {"host": NoCopy()})
    layer = LayerLayout(0, 0, 8, SLOT, (Segment(0, SLOT),))
    region = ((SLOT, 8 * SLOT),)
    spec = RegisterSpec("i", "m", 0, 1, 1, "cpu", "host", ENGINE_PID, region, (layer,))
    caller = Caller("unix", ENGINE_PID, 0)
    ctx = CallContext(caller, engine.register(spec, caller).owner_token)
    h = b"\x07" * 32

    async def scenario() -> None:
        assert (await engine.save("i", 0, np.arange(1), [h], None, 0, ctx)).stored == 1

    asyncio.run(scenario())
    got = engine.query("i", [h] * 1000, ctx=ctx)
    assert got.num_blocks == 1 and got.lease_id
    assert len(engine.leases.get(got.lease_id).entries) == 1
    pool.close()
