"""The block index alone (no server): plans against a reference model, owner
slots, node drops, TTL and eviction bookkeeping."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pegaflow.metaserver import compiled as compiled_loops
from pegaflow.metaserver.index import BlockIndex
from pegaflow.metaserver.meta_config import OWNERS_PER_BLOCK

NS = b"ns"
# The numpy plans, and the compiled loop's where numba is installed.
PLANNERS = pytest.mark.parametrize(
    "compiled",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                compiled_loops.plan() is None, reason="numba is not installed"
            ),
        ),
    ],
)


def _min_segments(holders: list[set[int]]) -> int:
    """Fewest segments covering the list, by dynamic programming."""
    n, best = len(holders), [0] + [10**9] * len(holders)
    for end in range(1, n + 1):
        common = set(holders[end - 1])
        for start in range(end - 1, -1, -1):
            if start < end - 1:
                common &= holders[start]
            if not common:
                break
            best[end] = min(best[end], best[start] + 1)
    return best[n]


def _check_plan(
    index: BlockIndex, model: dict[bytes, set[int]], keys: list[bytes], exclude: int
) -> None:
    """The plan covers exactly the longest prefix some owner but `exclude`
    holds, each segment's node holds its blocks, in the fewest segments."""
    holders = [model[k] - {exclude} for k in keys]
    covered = next((i for i, h in enumerate(holders) if not h), len(keys))
    plan = index.prefix(NS, keys, exclude)
    assert sum(count for _, count in plan) == covered
    at = 0
    for node, count in plan:
        assert node != exclude and count > 0
        assert all(node in model[k] for k in keys[at : at + count])
        at += count
    assert len(plan) == _min_segments(holders[:covered])


@PLANNERS
def test_plans_match_a_reference_model(compiled: bool) -> None:
    """Random inserts and removes by 4 nodes (every owner fits) over 60
    blocks, checked against a dict of owner sets: every plan covers exactly
    the longest prefix some non-excluded owner holds, each segment's node
    holds its blocks, and no plan has more segments than the fewest possible."""
    rng = random.Random(7)
    keys = [bytes([i]) * 8 for i in range(60)]
    for _ in range(30):
        index, model = BlockIndex(10_000, compiled=compiled), {k: set() for k in keys}
        for _ in range(40):
            node = rng.randrange(OWNERS_PER_BLOCK)
            chosen = rng.sample(keys, rng.randrange(1, 30))
            if rng.random() < 0.75:
                index.insert(NS, chosen, node, rng.random())
                for k in chosen:
                    model[k].add(node)
            else:
                index.remove(NS, chosen, node)
                for k in chosen:
                    model[k].discard(node)
        assert index.entries == sum(map(len, model.values()))
        for exclude in (-1, 0, 3):
            _check_plan(index, model, keys, exclude)


def test_fifth_owner_replaces_the_oldest_owner() -> None:
    """OWNERS_PER_BLOCK owners are remembered per block; one more replaces the
    one heard from longest ago, counted as owner_slots."""
    index = BlockIndex(100)
    for node in range(OWNERS_PER_BLOCK):
        index.insert(NS, [b"k"], node, float(node))
    index.insert(NS, [b"k"], 0, 10.0)  # node 0 refreshed: node 1 is now oldest
    index.insert(NS, [b"k"], 9, 11.0)
    assert index.entries == OWNERS_PER_BLOCK
    assert index.counters.dropped["owner_slots"] == 1
    assert index.node_entries[1] == 0 and index.node_entries[9] == 1
    assert index.prefix(NS, [b"k"], 9)[0][0] != 1


def test_drop_expire_evict_free_their_rows() -> None:
    """A dropped node's blocks, expired entries and evicted ones free their
    rows and namespaces; new blocks reuse the rows (no growth)."""
    index = BlockIndex(64)
    index.insert(NS, [b"a%d" % i for i in range(40)], 1, 1.0)
    index.insert(b"other", [b"b%d" % i for i in range(20)], 2, 2.0)
    assert index.drop_node(1, "stale_node") == 40 and index.namespaces == 1
    assert index.expire(3.0) == 20 and index.blocks == 0 and index.namespaces == 0
    rows = index._hwm
    index.insert(NS, [b"c%d" % i for i in range(60)], 3, 4.0)
    assert index._hwm == rows
    index.insert(NS, [b"d%d" % i for i in range(10)], 3, 5.0)
    assert index.entries <= 64
    assert index.counters.evicted == 70 - index.entries
    newest = index.prefix(NS, [b"d%d" % i for i in range(10)], -1)
    assert newest == [(3, 10)]
    assert int(np.sum(index.node_entries)) == index.entries


@PLANNERS
def test_plans_over_many_nodes_match_the_reference_model(
    monkeypatch, compiled: bool
) -> None:
    """As above with 24 nodes (past DENSE_PLAN_NODES: the plan walks the held
    entries, not a [nodes, blocks] matrix): the same plans, minimal."""
    from pegaflow.metaserver import index as index_module

    by_entry = []
    walk = index_module._plan_by_entry
    monkeypatch.setattr(
        index_module, "_plan_by_entry", lambda o: by_entry.append(1) or walk(o)
    )
    rng = random.Random(11)
    keys = [i.to_bytes(2, "big") * 4 for i in range(80)]
    for _ in range(20):
        index, model = BlockIndex(10_000, compiled=compiled), {k: set() for k in keys}
        for _ in range(60):
            node = rng.randrange(24)
            start = rng.randrange(len(keys))
            run = keys[start : start + rng.randrange(1, 25)]
            # every owner fits (the index keeps OWNERS_PER_BLOCK per block)
            chosen = [k for k in run if len(model[k] | {node}) <= OWNERS_PER_BLOCK]
            if not chosen:
                continue
            index.insert(NS, chosen, node, rng.random())
            for k in chosen:
                model[k].add(node)
        nodes = {o for h in model.values() for o in h}
        assert len(nodes) > index_module.DENSE_PLAN_NODES
        for exclude in (-1, 5):
            _check_plan(index, model, keys, exclude)
    assert compiled or len(by_entry) > 10  # most numpy plans took the entry walk


@PLANNERS
def test_a_plan_over_many_nodes_takes_memory_for_its_blocks_only(
    compiled: bool,
) -> None:
    """65,536 hashes held by 512 nodes (runs of 128 each, two owners a block):
    the [nodes, blocks] way took 807 MiB and 4 s for one such query."""
    import tracemalloc

    index = BlockIndex(1 << 20, compiled=compiled)
    keys = [i.to_bytes(4, "big") * 2 for i in range(65536)]
    for node in range(512):
        index.insert(NS, keys[node * 128 : (node + 1) * 128], node, 1.0)
        index.insert(NS, keys[((node + 1) % 512) * 128 : ((node + 1) % 512) * 128 + 64],
                     node, 1.0)  # fmt: skip
    tracemalloc.start()
    plan = index.prefix(NS, keys, -1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sum(count for _, count in plan) == 65536
    assert peak < 64 << 20, f"{peak >> 20} MiB"
