"""Recency after a warm restart (pegaflow.server.pool_check): the kept pool's
rows record none, so a recovered block the background check reaches enters
below every block used since the restart; one a query asked for is published
as just used, as any hit. The check's publishing once put every recovered
block at the most recent end, above the blocks engines had used meanwhile,
which then went first when the pool filled. Real pool file, store and check,
run here step by step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import AdmissionPolicy, LRUPolicy, TinyLFU
from pegaflow.cache.instances import Registry
from pegaflow.cache.prefix_eviction import PrefixLRUPolicy, make_policy
from pegaflow.common.keys import Namespace
from pegaflow.server.warm_restart import Recovered, find
from tests.keeper_tools import free
from tests.unit.test_slotlog import SLOT, _ns, _pool

FULL = 256  # the pool's slots (tests/unit/test_slotlog.py's POOL)


@pytest.fixture(autouse=True)
def _free_keepers(tmp_path: Path) -> Iterator[None]:
    yield
    for p in tmp_path.iterdir():
        free(p)


@pytest.mark.parametrize("kind", ["lru", "prefix"])
def test_blocks_used_since_a_restart_outlive_recovered_ones_nobody_used(
    tmp_path: Path, kind: str
) -> None:
    """Scenario: a full pool (256 blocks) is kept. After the restart a query
    asks for 16 of them (blocks 100-115): checked at once and hit. The
    background check then reaches the other 240. A new namespace's save of
    240 blocks evicts exactly those 240; the 16 used stay served."""
    path = tmp_path / "pool.bin"
    pool = _pool(path)
    store = BlockStore(pool.slabs, LRUPolicy())
    hashes = [i.to_bytes(4, "little") for i in range(FULL)]
    store.finish_save(store.reserve_save(_ns(), 0, hashes, np.arange(2)), True)
    assert pool.log.drain(30)
    pool.close()

    pool = _pool(path)
    store = BlockStore(pool.slabs, make_policy(kind))  # type: ignore[arg-type]
    check = find(pool, store, Recovered(Registry({})))
    assert check is not None
    store.add_listener(check)  # as the server adds its tiers
    ns_id = check._p.entries[0].key[0]
    used = hashes[100:116]
    asked = check.lookup(SimpleNamespace(namespace=SimpleNamespace(id=ns_id)), used, 0)
    assert (asked.state, asked.blocks) == ("loading", 16)
    batch = check._next()  # the query's blocks first
    assert batch is not None and len(batch) == 16
    check._publish(batch, check._check(batch))
    recovered = SimpleNamespace(id=ns_id)
    assert len(store.longest_prefix(recovered, used)) == 16  # the engine's hit
    check.run_here()  # the background pass reaches the rest
    assert check.outcome.unchecked == 0 and len(store.entries) == FULL

    other = Namespace("other", 99, 1, 2, SLOT, (2, SLOT // 2, SLOT // 2))
    new = [b"new" + i.to_bytes(2, "little") for i in range(FULL - 16)]
    res = store.reserve_save(other, 0, new, np.arange(2))
    assert (len(res.keys), res.rejected) == (FULL - 16, 0)
    store.finish_save(res, True)
    assert store.counters.evictions == FULL - 16
    assert len(store.longest_prefix(recovered, used)) == 16
    pool.close()


@pytest.mark.parametrize(
    "policy",
    [LRUPolicy, PrefixLRUPolicy, lambda: AdmissionPolicy(LRUPolicy(), TinyLFU(64))],
    ids=["lru", "prefix", "admission"],
)
def test_cold_keys_enter_below_every_resident_key_in_order(policy) -> None:
    """insert_cold_many: below the keys already there, the first of them
    evicted first, and (behind admission) not counted as an access."""
    p = policy()
    p.insert("a")
    p.insert("b")
    sketch = getattr(p, "_sketch", None)
    samples = None if sketch is None else sketch._samples
    p.insert_cold_many(["x", "y", "z"])
    assert samples is None or sketch._samples == samples  # no access recorded
    assert p.evict(5, lambda key: False) == ["x", "y", "z", "a", "b"]
