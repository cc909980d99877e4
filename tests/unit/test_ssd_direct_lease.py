"""The direct SSD → GPU route's bookkeeping (pegaflow.tiers.ssd_gpu_direct), in
process: a query answers `ready` at once with a lease whose tail is the SSD
blocks after the L1 hits, and a load splits each item between the L1 copy
and one direct read of the tail, reads the tail first, and turns blocks the
read could not land into item errors. The real bytes of this route move only
on a GPU (tests/gpu/test_gpu_server.py); here a recording reader stands in
for kvikio and a recording copier for the copy kernels."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
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
from pegaflow.tiers.ssd_gpu_direct import SsdDirect
from tests.unit.host_engine import ssd_link
from tests.unit.stand_in_engine import ENGINE_PID

PAGE = 4096
HASHES = [bytes([i]) * 32 for i in range(12)]
IN_L1, ON_SSD = HASHES[:4], HASHES[4:9]


class Tier:
    """The tier's surface SsdLink uses; ON_SSD are on the SSD."""

    config = SimpleNamespace(admission="all", write_on="evict")

    def spill_many(self, *args) -> list[int]:
        return []

    def queue_room(self) -> int:
        return 1 << 20

    def refuse_many(self, *args) -> None:
        pass

    def lookup(self, digest, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in ON_SSD:
            n += 1
        return n

    def __init__(self) -> None:
        self.l1_loads = 0

    def load(self, *args) -> Future:
        self.l1_loads += 1  # the L1 route's read: never done here
        return Future()


class Copier:
    def __init__(self, log: list) -> None:
        self.log = log

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def gather(self, handle, t: Transfers, wait_event=0, deadline=None) -> None:
        pass

    def scatter(self, handle, t: Transfers, deadline=None) -> None:
        self.log.append(("l1", len(t)))

    def close(self, handle: object) -> None:
        pass


class Reader(SsdDirect):
    """SsdDirect with its kvikio read replaced: records each read, and lands
    every block but those in `fails`."""

    def __init__(self, engine: Engine, copier: Copier, log: list) -> None:
        super().__init__(
            ssd_link(engine, Tier()), copier, engine.metrics.ssd, reads=self
        )
        self.log, self.fails = log, set()
        self.watched: list = []  # L1 entries whose pins a read records
        self.pins_seen: list[int] = []

    def _read(self, worker, digest, hashes, block_ids, deadline) -> np.ndarray:
        self.log.append(("direct", list(hashes), block_ids.tolist()))
        self.pins_seen = [e.pins for e in self.watched]
        return np.array([h not in self.fails for h in hashes], bool)

    async def close(self) -> None:  # no kvikio files to close
        self._threads.shutdown()


@pytest.fixture
def setup():
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    log: list = []
    copier = Copier(log)
    engine = Engine(EngineConfig(), pool, {"host": copier})
    reader = Reader(engine, copier, log)
    engine.add_tier(reader)  # asked first, as the server orders them
    engine.add_tier(reader._link)
    layer = LayerLayout(0, 0, 64, PAGE, (Segment(0, PAGE),))
    region = ((PAGE, 64 * PAGE),)
    spec = RegisterSpec("i", "m", 0, 1, 1, "cpu", "host", ENGINE_PID, region, (layer,))
    caller = Caller("unix", ENGINE_PID, 0)
    ctx = CallContext(caller, engine.register(spec, caller).owner_token)
    asyncio.run(engine.save("i", 0, np.arange(4), IN_L1, None, 0, ctx))
    yield engine, ctx, log
    asyncio.run(reader.close())
    engine.close()
    pool.close()


def sample(engine: Engine, name: str, **labels: str) -> float:
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


def load(engine: Engine, ctx: CallContext, items: list, batch: bool = True):
    return asyncio.run(engine.load("i", 0, items, batch, 0, ctx))


def test_a_query_leases_the_ssd_tail_ready_at_once(setup) -> None:
    engine, ctx, _ = setup
    got = engine.query("i", HASHES, ctx=ctx)
    assert not got.loading and got.num_blocks == 9
    lease = engine.leases.get(got.lease_id)
    assert [e.key[1] for e in lease.entries] == IN_L1 and lease.direct == ON_SSD
    assert sample(engine, "pegaflow_ssd_hit_blocks_total") == 5
    assert engine.tiers[1].tier.l1_loads == 0
    # An instance the route does not serve (not this copier's) loads via L1.
    engine.tiers[0]._cuda = object()

    async def via_l1() -> bool:  # its background load runs on the loop
        return engine.query("i", HASHES, ctx=ctx).loading

    assert asyncio.run(via_l1())
    assert engine.tiers[1].tier.l1_loads == 1


def test_a_load_reads_the_tail_first_then_copies_the_l1_part(setup) -> None:
    engine, ctx, log = setup
    lease = engine.query("i", HASHES, ctx=ctx).lease_id
    ids = np.arange(20, 29)
    got = load(engine, ctx, [(lease, 0, ids)])
    assert got.loaded == 9 and not got.items[0].error
    assert got.items[0].bytes == 9 * PAGE
    assert log == [("direct", ON_SSD, list(range(24, 29))), ("l1", 4)]
    loaded = sample(engine, "pegaflow_ssd_direct_blocks_total", result="loaded")
    assert loaded == 5
    assert lease not in engine.leases  # consumed by the one worker


def test_the_l1_part_stays_pinned_while_the_ssd_part_is_read(setup) -> None:
    """The lease may expire during the read (a slow disk): the load's own
    pins must hold the L1 blocks from before it, or they could be evicted
    and their slots reused before the copy reads them."""
    engine, ctx, _ = setup
    lease = engine.leases.get(engine.query("i", HASHES, ctx=ctx).lease_id)
    engine.tiers[0].watched = lease.entries
    load(engine, ctx, [(lease.id, 0, np.arange(20, 29))])
    assert engine.tiers[0].pins_seen and min(engine.tiers[0].pins_seen) >= 1


def test_a_load_of_the_ssd_part_alone_copies_nothing(setup) -> None:
    engine, ctx, log = setup
    lease = engine.query("i", HASHES, ctx=ctx).lease_id
    got = load(engine, ctx, [(lease, 4, np.arange(30, 35))])
    assert got.loaded == 5 and not got.items[0].error
    assert log == [("direct", ON_SSD, list(range(30, 35)))]


def test_items_split_at_the_end_of_the_l1_part(setup) -> None:
    engine, ctx, log = setup
    lease = engine.query("i", HASHES, ctx=ctx).lease_id
    l1_only, both, ssd_only = np.arange(30, 32), np.arange(40, 44), np.arange(50, 52)
    items = [(lease, 0, l1_only), (lease, 2, both), (lease, 7, ssd_only)]
    got = load(engine, ctx, items)
    assert [r.loaded for r in got.items] == [2, 4, 2]
    hashes = ON_SSD[:2] + ON_SSD[3:5]  # items 2 and 3, one read for both
    assert log == [("direct", hashes, [42, 43, 50, 51]), ("l1", 4)]


def test_blocks_the_read_did_not_land_fail_their_item(setup) -> None:
    engine, ctx, log = setup
    engine.tiers[0].fails = {ON_SSD[1]}
    lease = engine.query("i", HASHES, ctx=ctx).lease_id
    ok_ids, bad_ids = np.arange(10, 14), np.arange(20, 25)
    got = load(engine, ctx, [(lease, 0, ok_ids), (lease, 4, bad_ids)])
    assert not got.items[0].error and got.items[0].loaded == 4
    assert "items[1].block_ids: 1 of the blocks read from the SSD" in got.items[1].error
    assert "recompute" in got.items[1].error and got.items[1].loaded == 4
    failed = sample(engine, "pegaflow_ssd_direct_blocks_total", result="failed")
    assert failed == 1
    lease = engine.query("i", HASHES, ctx=ctx).lease_id
    with pytest.raises(CopyFailed, match="block_ids: 1 of the blocks read"):
        load(engine, ctx, [(lease, 0, np.arange(9))], batch=False)


def test_bad_items_over_the_tail_are_refused_before_any_read(setup) -> None:
    engine, ctx, log = setup
    lease = engine.query("i", HASHES, ctx=ctx).lease_id
    with pytest.raises(InvalidRequest, match=r"items\[0\]\.block_ids: .* the 9 leased"):
        load(engine, ctx, [(lease, 5, np.arange(5))])
    with pytest.raises(InvalidRequest, match="engine block 3 is loaded into more"):
        load(engine, ctx, [(lease, 0, np.arange(4)), (lease, 4, np.array([3]))])
    assert log == []  # nothing read, nothing copied


def test_a_load_once_the_route_closes_fails_cleanly(setup) -> None:
    """Regression: a Load reaching the direct route as it closed (the server
    stopping) handed its read to a shut thread pool: the pool's bare
    RuntimeError. Now it fails with a CopyFailed saying so, nothing read."""
    engine, ctx, log = setup

    class Reads:
        def close(self) -> None:
            pass

    direct = SsdDirect(
        engine.tiers[0]._link, engine.tiers[0]._cuda, engine.metrics.ssd, Reads()
    )
    worker = next(iter(engine.registry.instance("i").workers.values()))

    async def close_then_load() -> None:
        await direct.close()  # (the flag a load checks is set as close begins)
        with pytest.raises(CopyFailed, match="server is stopping"):
            await direct.load(worker, ON_SSD[:1], np.array([0]), None)

    asyncio.run(close_then_load())
    assert not [e for e in log if e[0] == "direct"]
