"""Inserts from several nodes and the prefix plan, through a real metaserver."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pegaflow.metaserver.meta_client import MetaClient
from tests.metaserver.conftest import hashes
from tests.procs import ServerProc

NS = b"\x01" * 32


@pytest.fixture
def meta(metaserver_factory: Callable[..., ServerProc]) -> ServerProc:
    return metaserver_factory()


def plan(client: MetaClient, prefix: list[bytes], ns: bytes = NS) -> list:
    return [(s.node_id, s.blocks) for s in client.query(ns, prefix)]


def test_plan_across_two_owners_excludes_the_asker(
    meta: ServerProc, node_factory: Callable[..., MetaClient]
) -> None:
    """Node A holds blocks 0-59, node B 40-99: a third node's 100-hash query is
    A for 60 then B for 40 (the longest runs, no split inside a run); A's own
    query skips A and gets nothing (B does not hold block 0); B's gets A's 60
    and stops there: only B itself holds the rest."""
    a, b, c = (node_factory(meta, name) for name in ("node-a", "node-b", "node-c"))
    for node, port in ((a, 1), (b, 2), (c, 3)):
        node.join(f"10.0.0.{port}:1700{port}")
    prefix = hashes(100)
    assert a.insert(NS, prefix[:60]) == (60, 0)
    assert b.insert(NS, prefix[40:]) == (60, 0)
    got = c.query(NS, prefix)
    assert [(s.node_id, s.endpoint, s.incarnation, s.blocks) for s in got] == [
        ("node-a", "10.0.0.1:17001", 1, 60),
        ("node-b", "10.0.0.2:17002", 1, 40),
    ]
    assert plan(a, prefix) == []
    assert plan(b, prefix) == [("node-a", 60)]
    assert plan(c, prefix[50:]) == [("node-b", 50)]


def test_plan_stops_at_the_first_hash_nobody_holds(
    meta: ServerProc, node_factory: Callable[..., MetaClient]
) -> None:
    """Blocks 0-9 on A, 11-19 on B, nobody holds 10: the plan covers 0-9 only;
    another namespace with the same hashes answers nothing."""
    a, b, c = node_factory(meta), node_factory(meta), node_factory(meta)
    for node in (a, b, c):
        node.join("127.0.0.1:1")
    prefix = hashes(20)
    a.insert(NS, prefix[:10])
    b.insert(NS, prefix[11:])
    assert plan(c, prefix) == [(a.node.node_id, 10)]
    assert plan(c, prefix, ns=b"\x02" * 32) == []
    assert plan(c, []) == []


def test_interleaved_owners_give_alternating_segments(
    meta: ServerProc, node_factory: Callable[..., MetaClient]
) -> None:
    """A holds even-numbered runs of 5, B odd ones: the plan alternates every 5
    blocks and its counts add up to the whole prefix."""
    a, b, c = node_factory(meta, "a"), node_factory(meta, "b"), node_factory(meta)
    for node in (a, b, c):
        node.join("127.0.0.1:1")
    prefix = hashes(40)
    for run in range(8):
        (a if run % 2 == 0 else b).insert(NS, prefix[run * 5 : run * 5 + 5])
    assert plan(c, prefix) == [("a", 5), ("b", 5)] * 4
    both = prefix[:5]
    b.insert(NS, both)  # now b holds 0-9 unbroken: one segment covers them
    assert plan(c, prefix)[:2] == [("b", 10), ("a", 5)]


def test_remove_refresh_and_leave(
    meta: ServerProc, node_factory: Callable[..., MetaClient]
) -> None:
    """A re-insert refreshes (no new entry), a duplicate inside one batch is one
    entry, Remove withdraws only the caller's entries, Leave drops the node
    with everything it held."""
    a, b, c = node_factory(meta), node_factory(meta), node_factory(meta)
    for node in (a, b, c):
        node.join("127.0.0.1:1")
    prefix = hashes(30)
    assert a.insert(NS, prefix + prefix[:5]) == (30, 0)
    assert a.insert(NS, prefix[:10]) == (0, 10)
    assert b.insert(NS, prefix[:10]) == (10, 0)
    assert a.heartbeat() == 30 and b.heartbeat() == 10
    assert b.remove(NS, prefix[:30]) == 10  # only its own 10
    assert a.remove(NS, prefix[20:]) == 10
    assert a.heartbeat() == 20
    assert plan(c, prefix) == [(a.node.node_id, 20)]
    assert a.leave() == 20
    assert plan(c, prefix) == []
    assert meta.metric("pegaflow_meta_entries") == 0
    assert meta.metric("pegaflow_meta_blocks") == 0
    assert meta.metric("pegaflow_meta_namespaces") == 0
    status, body = meta.get("/health")
    assert status == 200 and b'"nodes": 2' in body
