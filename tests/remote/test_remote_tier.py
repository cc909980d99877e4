"""The L2 remote tier across network namespaces: a block saved on one node is
read one-sided by another, every byte checked; every failure is a miss."""

from __future__ import annotations

import grpc
import pytest

from pegaflow.common.peer_auth import METADATA_KEY
from pegaflow.metaserver.meta_client import MetaClient
from pegaflow.proto import peer_pb2 as pb
from pegaflow.proto import peer_pb2_grpc as pb_grpc
from tests.remote.conftest import TOKEN, Cluster, block_hashes

pytestmark = pytest.mark.timeout(240)


def _save(cluster: Cluster, node: int, instance: str, seed: int, n: int, tag: str):
    """An engine on `node` saves n blocks; (engine, ids, hashes, digests)."""
    owner = cluster.engine(node, instance, seed)
    ids = list(range(3, 3 + n))
    hashes = block_hashes(tag, n)
    assert owner.call("save", block_ids=ids, hashes=hashes)["stored"] == n
    return owner, ids, hashes, owner.call("digest", block_ids=ids)["digests"]


def _advertised(cluster: Cluster, node: int, at_least: int) -> None:
    cluster.wait_remote(node, lambda r: r["advertised"] >= at_least, "advertising")


def test_remote_hit_every_byte(cluster: Cluster) -> None:
    """Scenario: engine A on node 0 saves 24 blocks; engine B on node 1 (its
    own namespace and address, host KV) queries them: `loading` while node 1
    reads them from node 0, then a hit it loads into other block ids, equal
    byte for byte to what A saved."""
    before = cluster.remote(0)["advertised"]
    _, ids, hashes, digests = _save(cluster, 0, "hit-a", 1, 24, "hit")
    _advertised(cluster, 0, before + 24)
    reader = cluster.engine(1, "hit-b", 2)
    got = reader.call("query", hashes=hashes, wait_s=20)
    assert got["num_blocks"] == 24 and got["polls"] > 0, got
    dst = list(range(40, 64))
    assert reader.call("load", lease_id=got["lease_id"], block_ids=dst)["loaded"] == 24
    assert reader.call("digest", block_ids=dst)["digests"] == digests
    stats = cluster.remote(1)
    assert stats["fetched_blocks"] >= 24 and stats["fetched_bytes"] > 0
    assert all(v == 0 for v in stats["failed_blocks"].values()), stats
    assert cluster.servers[1].metric("pegaflow_remote_hit_blocks_total") >= 24
    # what node 0 served, and that its pin went back
    cluster.wait_remote(0, lambda r: r["pins_held"] == 0, "the pin's release")


def test_never_fetched_twice_and_asker_excluded(cluster: Cluster) -> None:
    """Scenario: the owner itself misses a prefix it never had: the metaserver
    never plans a read from the asker, so the owner answers a miss."""
    owner = cluster.engine(2, "self-a", 3)
    hashes = block_hashes("self", 4)
    got = owner.call("query", hashes=hashes, wait_s=5)
    assert got["num_blocks"] == 0 and not got["loading"]


def test_wrong_or_missing_token_refused(cluster: Cluster) -> None:
    """Scenario: a client on the network calls a node's Peer service or the
    metaserver without the cluster's token, or with another: UNAUTHENTICATED,
    and nothing is pinned."""
    addr = cluster.servers[0].addr
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.PeerStub(channel)
        request = pb.PinRequest(namespace=b"x" * 16, hash_len=4, hashes=b"abcd")
        for metadata in ((), ((METADATA_KEY, "w" * 32),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Pin(request, timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in (err.value.details() or "")
        ok = stub.Pin(request, timeout=5, metadata=((METADATA_KEY, TOKEN),))
        assert ok.pin_id == 0  # authenticated: nothing of that namespace here
    for token in (None, "w" * 32):
        client = MetaClient(cluster.meta_addr, "intruder", 1, token)
        with pytest.raises(grpc.RpcError) as err:
            client.join("rpc=1.2.3.4:1;te=1.2.3.4:2")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client.close()
