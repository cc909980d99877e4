"""What the metaserver refuses and forgets: malformed requests, --max-entries
eviction, --ttl-minutes expiry, and memory that stays bounded."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from pegaflow.metaserver.meta_client import MetaClient
from pegaflow.proto import metaserver_pb2 as pb
from tests.metaserver.conftest import hashes, rss_bytes, start_metaserver, wait_for
from tests.procs import ServerProc

NS = b"\x05" * 32


def _node(node_id: str = "n1", incarnation: int = 1) -> pb.NodeRef:
    return pb.NodeRef(node_id=node_id, incarnation=incarnation)


def _blocks(
    ns: bytes = NS, hash_len: int = 32, data: bytes = b"\x00" * 64
) -> pb.Blocks:
    return pb.Blocks(namespace=ns, hash_len=hash_len, hashes=data)


MALFORMED = [
    ("Join", pb.JoinRequest(node=_node(""), endpoint="h:1"), "node.node_id"),
    ("Join", pb.JoinRequest(node=_node("a b"), endpoint="h:1"), "node.node_id"),
    ("Join", pb.JoinRequest(node=_node("x" * 129), endpoint="h:1"), "node.node_id"),
    ("Join", pb.JoinRequest(node=_node("n\u00e9"), endpoint="h:1"), "node.node_id"),
    (
        "Join",
        pb.JoinRequest(node=_node(incarnation=0), endpoint="h:1"),
        "node.incarnation",
    ),
    (
        "Join",
        pb.JoinRequest(node=_node(incarnation=2**64 - 1), endpoint="h:1"),
        "node.incarnation",
    ),
    (
        "Heartbeat",
        pb.HeartbeatRequest(node=_node(incarnation=2**63)),
        "node.incarnation",
    ),
    ("Join", pb.JoinRequest(node=_node(), endpoint=""), "endpoint"),
    ("Join", pb.JoinRequest(node=_node(), endpoint="h:1\n"), "endpoint"),
    ("Join", pb.JoinRequest(node=_node(), endpoint="h" * 257), "endpoint"),
    ("Heartbeat", pb.HeartbeatRequest(), "node.node_id"),
    ("Insert", pb.InsertRequest(node=_node()), "blocks.namespace"),
    (
        "Insert",
        pb.InsertRequest(node=_node(), blocks=_blocks(ns=b"")),
        "blocks.namespace",
    ),
    (
        "Insert",
        pb.InsertRequest(node=_node(), blocks=_blocks(ns=b"n" * 65)),
        "blocks.namespace",
    ),
    (
        "Insert",
        pb.InsertRequest(node=_node(), blocks=_blocks(hash_len=0)),
        "blocks.hash_len",
    ),
    (
        "Insert",
        pb.InsertRequest(node=_node(), blocks=_blocks(hash_len=65)),
        "blocks.hash_len",
    ),
    (
        "Insert",
        pb.InsertRequest(node=_node(), blocks=_blocks(data=b"\x00" * 33)),
        "blocks.hashes",
    ),
    (
        "Insert",
        pb.InsertRequest(
            node=_node(), blocks=_blocks(hash_len=1, data=b"\x00" * 65537)
        ),
        "blocks.hashes",
    ),
    (
        "Remove",
        pb.RemoveRequest(node=_node(), blocks=_blocks(hash_len=7)),
        "blocks.hashes",
    ),
    (
        "QueryPrefix",
        pb.QueryPrefixRequest(blocks=_blocks(hash_len=0)),
        "blocks.hash_len",
    ),
    (
        "QueryPrefix",
        pb.QueryPrefixRequest(blocks=_blocks(), asker_node_id="a\tb"),
        "asker_node_id",
    ),
    ("Leave", pb.LeaveRequest(node=_node(incarnation=0)), "node.incarnation"),
]


def test_malformed_requests_name_the_field(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """Every malformed field is refused INVALID_ARGUMENT naming it, checked
    before the node is looked up (n1 has joined, so only the field is wrong);
    a message over 8 MiB is refused by gRPC; the metaserver keeps serving."""
    meta = metaserver_factory()
    client = node_factory(meta, "n1")
    client.join("h:1")
    for method, request, field in MALFORMED:
        with pytest.raises(grpc.RpcError) as info:
            client.call(method, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field)
        assert info.value.details().startswith(field + ":"), info.value.details()
    huge = pb.InsertRequest(node=_node(), blocks=_blocks(data=b"\x00" * (9 << 20)))
    with pytest.raises(grpc.RpcError) as info:
        client.call("Insert", huge)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    prefix = hashes(3)
    assert client.insert(NS, prefix) == (3, 0)
    assert meta.metric("pegaflow_meta_entries") == 3


def test_eviction_at_max_entries_oldest_first(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """--max-entries 1000: A advertises 500, then B 500 (full), then A 100
    more. The 100 evicted are the oldest (A's first batch): B keeps all 500,
    A holds 500, the eviction metric says 100 and the entries gauge 1000."""
    meta = metaserver_factory("--max-entries", "1000")
    a, b, asker = node_factory(meta, "a"), node_factory(meta, "b"), node_factory(meta)
    for node in (a, b, asker):
        node.join("127.0.0.1:1")
    first, second, third = hashes(500), hashes(500), hashes(100)
    a.insert(NS, first)
    b.insert(NS, second)
    assert meta.metric("pegaflow_meta_evicted_entries_total") == 0
    a.insert(NS, third)
    assert meta.metric("pegaflow_meta_evicted_entries_total") == 100
    assert meta.metric("pegaflow_meta_entries") == 1000
    assert (a.heartbeat(), b.heartbeat()) == (500, 500)
    assert [(s.node_id, s.blocks) for s in asker.query(NS, second)] == [("b", 500)]
    assert [(s.node_id, s.blocks) for s in asker.query(NS, third)] == [("a", 100)]
    held = sum(bool(asker.query(NS, [h])) for h in first)
    assert held == 400


def test_entries_expire_after_ttl(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """--ttl-minutes 0.05 (3 s): 40 advertised entries are dropped once they
    are older than that (polled with a deadline), counted as reason ttl; the
    node itself stays joined."""
    meta = metaserver_factory("--ttl-minutes", "0.05")
    node, asker = node_factory(meta), node_factory(meta)
    node.join("127.0.0.1:1")
    asker.join("127.0.0.1:2")
    prefix = hashes(40)
    assert node.insert(NS, prefix) == (40, 0)

    def expired() -> bool:
        return meta.metric("pegaflow_meta_dropped_entries_total", 'reason="ttl"') >= 40

    wait_for(expired, 30, "the TTL sweep")
    assert asker.query(NS, prefix) == []
    assert node.heartbeat() == 0
    assert meta.metric("pegaflow_meta_blocks") == 0


def test_rss_bounded_past_max_entries(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """--max-entries 50000: ten times that many fresh hashes go in; entries
    stay at the bound and the process's RSS after the tenth round is within
    a quarter (plus 16 MiB) of what it was once the index was first full."""
    meta = metaserver_factory("--max-entries", "50000")
    node = node_factory(meta)
    node.join("127.0.0.1:1")
    full = 0
    for round_ in range(10):
        for _ in range(5):
            node.insert(NS, hashes(10000))
        assert meta.metric("pegaflow_meta_entries") <= 50000
        if round_ == 1:
            full = rss_bytes(meta.pid)
    assert meta.metric("pegaflow_meta_evicted_entries_total") >= 400000
    assert rss_bytes(meta.pid) <= full * 1.25 + (16 << 20)


@pytest.fixture(scope="module")
def undecodable_meta(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProc]:
    """One metaserver for every method's undecodable body: a body that does
    not parse changes nothing in it, and its log is checked after each call
    (a traceback from any call fails that call's case). Saves five starts
    and stops (~2 s each on two quiet cores, 10-20 s each on a loaded one)."""
    srv = start_metaserver(tmp_path_factory.mktemp("undecodable"))
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "method", ["Join", "Heartbeat", "Insert", "Remove", "QueryPrefix", "Leave"]
)
def test_an_undecodable_body_is_invalid_argument(
    undecodable_meta: ServerProc, method: str
) -> None:
    """Any bytes a client sends: INVALID_ARGUMENT naming the request, no
    traceback (grpc answered a body that did not parse UNKNOWN, logging one)."""
    srv = undecodable_meta
    service = "/pegaflow.meta.v1.MetaServer"
    with grpc.insecure_channel(srv.addr) as channel:
        call = channel.unary_unary(f"{service}/{method}")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff" * 64, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("request: ")
    assert "Traceback" not in srv.log.read_text()
