"""The block index alone (no server): plans against a reference model, owner
slots, node drops, TTL and eviction bookkeeping."""

from __future__ import annotations

import random

import numpy as np

from pegaflow.metaserver.config import OWNERS_PER_BLOCK
from pegaflow.metaserver.index import BlockIndex

NS = b"ns"


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


def test_plans_match_a_reference_model() -> None:
    """Random inserts and removes by 4 nodes (every owner fits) over 60
    blocks, checked against a dict of owner sets: every plan covers exactly
    the longest prefix some non-excluded owner holds, each segment's node
    holds its blocks, and no plan has more segments than the fewest possible."""
    rng = random.Random(7)
    keys = [bytes([i]) * 8 for i in range(60)]
    for _ in range(30):
        index, model = BlockIndex(10_000), {k: set() for k in keys}
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
