"""Node lifecycle through a real metaserver: incarnations, staleness, and the
re-advertise contract after a metaserver restart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import grpc
import pytest

from pegaflow.metaserver.meta_client import MetaClient
from tests.metaserver.conftest import hashes, wait_for
from tests.procs import ServerProc

NS = b"\x07" * 32


def _refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_newer_incarnation_fences_the_old_entries(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """Node A (incarnation 1) advertises 50 blocks and restarts as incarnation
    2: its first heartbeat drops incarnation 1's entries and answers
    FAILED_PRECONDITION "unknown incarnation"; after Join it re-advertises. The
    old process's late heartbeats and inserts are refused as superseded and
    never land."""
    meta = metaserver_factory()
    old = node_factory(meta, "node-a", incarnation=1)
    new = node_factory(meta, "node-a", incarnation=2)
    asker = node_factory(meta)
    old.join("10.0.0.1:1")
    asker.join("10.0.0.9:1")
    prefix = hashes(50)
    old.insert(NS, prefix)
    assert sum(s.blocks for s in asker.query(NS, prefix)) == 50
    code, details = _refused(new.heartbeat)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown incarnation" in details
    assert asker.query(NS, prefix) == []
    assert meta.metric("pegaflow_meta_dropped_entries_total", 'reason="fenced"') == 50
    new.join("10.0.0.1:2")
    new.insert(NS, prefix[:20])
    code, details = _refused(lambda: old.insert(NS, prefix))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "superseded incarnation" in details
    assert "superseded" in _refused(old.heartbeat)[1]
    assert "superseded" in _refused(lambda: old.join("10.0.0.1:1"))[1]
    segments = asker.query(NS, prefix)
    assert [(s.incarnation, s.endpoint, s.blocks) for s in segments] == [
        (2, "10.0.0.1:2", 20)
    ]
    # A Join of a newer incarnation fences just as a heartbeat does.
    newest = node_factory(meta, "node-a", incarnation=3)
    newest.join("10.0.0.1:3")
    assert asker.query(NS, prefix) == []
    assert meta.metric("pegaflow_meta_dropped_entries_total", 'reason="fenced"') == 70


def test_stale_node_dropped_with_its_entries(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """With --node-stale-secs 3, node B advertises and then goes silent while
    node A keeps heartbeating: B and its entries are dropped, A's stay; B's
    next heartbeat gets "unknown incarnation" (the cue to re-join)."""
    meta = metaserver_factory("--node-stale-secs", "3")
    a, b = node_factory(meta, "node-a"), node_factory(meta, "node-b")
    asker = node_factory(meta)
    for node in (a, b, asker):
        node.join("127.0.0.1:1")
    mine, theirs = hashes(10), hashes(10)
    a.insert(NS, mine)
    b.insert(NS, theirs)

    def b_dropped() -> bool:
        a.heartbeat()
        asker.heartbeat()
        return meta.metric("pegaflow_meta_node_events_total", 'event="stale"') >= 1

    wait_for(b_dropped, 30, "node-b to be dropped as stale")
    assert asker.query(NS, theirs) == []
    assert [s.blocks for s in asker.query(NS, mine)] == [10]
    assert (
        meta.metric("pegaflow_meta_dropped_entries_total", 'reason="stale_node"') == 10
    )
    code, details = _refused(b.heartbeat)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown incarnation" in details


def test_metaserver_restart_then_nodes_readvertise(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """The metaserver holds soft state: restarted on its port, it knows
    nothing; a node's heartbeat gets FAILED_PRECONDITION "unknown incarnation",
    the node joins again and re-sends its whole list, and the index answers
    the same plan as before the restart."""
    first = metaserver_factory()
    a, b = node_factory(first, "node-a"), node_factory(first, "node-b")
    asker = node_factory(first, "asker")
    for node in (a, b, asker):
        node.join("127.0.0.1:1")
    prefix = hashes(64)
    held = {a: prefix[:32], b: prefix[32:]}
    for node, blocks in held.items():
        node.insert(NS, blocks)
    before = [(s.node_id, s.blocks) for s in asker.query(NS, prefix)]
    assert before == [("node-a", 32), ("node-b", 32)]
    first.stop()
    second = metaserver_factory("--addr", first.addr)  # the same port
    for node in (a, b, asker):  # the contract every node follows
        code, details = _refused(node.heartbeat)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "unknown incarnation" in details
        node.join("127.0.0.1:1")
        if node in held:
            node.insert(NS, held[node])
    assert [(s.node_id, s.blocks) for s in asker.query(NS, prefix)] == before
    assert second.metric("pegaflow_meta_entries") == 64


def test_a_node_reaches_a_metaserver_back_from_an_outage_within_a_second(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """A node's channel tries to reconnect at least every second
    (pegaflow.common.channels). With gRPC's default backoff (1 s, 1.6 times a
    try) a metaserver down for ~10 s was reached 2.5 s or more after it came
    back, every call failing at once meanwhile: after an outage of minutes,
    up to two minutes late."""
    first = metaserver_factory()
    node = node_factory(first, "node-a")
    node.join("127.0.0.1:1")
    first.stop(signal.SIGKILL)
    down_until = time.monotonic() + 10.0
    while time.monotonic() < down_until:  # calls fail: the channel backs off
        code, _ = _refused(node.heartbeat)
        assert code == grpc.StatusCode.UNAVAILABLE
        time.sleep(0.25)
    metaserver_factory("--addr", first.addr)  # the same port, READY
    back = time.monotonic()
    while (code := _refused(node.heartbeat)[0]) == grpc.StatusCode.UNAVAILABLE:
        assert time.monotonic() - back < 2.5, "still backing off"
        time.sleep(0.02)
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # it knows us not: join
