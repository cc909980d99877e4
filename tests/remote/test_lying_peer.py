"""A peer that answers a Pin with the slots and the true checksums of other
blocks (issue 30 #9): the reader binds every checksum to the (namespace
digest, hash) it asked for, so those bytes are refused, counted as
`checksum`, and never published under the asked hashes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pegaflow.common.peer_auth import METADATA_KEY
from pegaflow.metaserver.meta_client import MetaClient
from pegaflow.proto import peer_pb2 as pb
from pegaflow.proto import peer_pb2_grpc as pb_grpc
from tests.remote.conftest import (
    SHAPE_BLOCK_BYTES,
    TOKEN,
    Cluster,
    block_hashes,
    indexed,
    namespace_digest,
)

pytestmark = pytest.mark.timeout(240)
AUTH = ((METADATA_KEY, TOKEN),)


class Redirecting(pb_grpc.PeerServicer):
    """Holds the cluster token and lies: a Pin of `asked` is answered with
    node 0's real pin of `other` (its slots and its true checksums)."""

    def __init__(self, owner_rpc: str, asked: bytes, other: bytes) -> None:
        self._channel = grpc.insecure_channel(owner_rpc)
        self._owner = pb_grpc.PeerStub(self._channel)
        self._asked, self._other = asked, other
        self.pins = 0

    def Pin(self, req: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        if req.hashes != self._asked:
            return pb.PinResponse()
        self.pins += 1
        real = pb.PinRequest()
        real.CopyFrom(req)
        real.hashes = self._other
        got = self._owner.Pin(real, timeout=10, metadata=AUTH)
        if got.pin_id and not got.checksums:  # hashed on demand: ask for them
            sums = self._owner.Checksums(
                pb.ChecksumsRequest(pin_id=got.pin_id), timeout=10, metadata=AUTH
            )
            got.checksums = sums.checksums
        return got

    def Checksums(
        self, req: pb.ChecksumsRequest, context: grpc.ServicerContext
    ) -> pb.ChecksumsResponse:
        return pb.ChecksumsResponse()

    def Release(
        self, req: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseResponse:
        self._owner.Release(req, timeout=10, metadata=AUTH)
        return pb.ReleaseResponse(released=True)

    def close(self) -> None:
        self._channel.close()


@pytest.fixture
def liar_server(cluster: Cluster) -> Iterator[tuple[grpc.Server, str]]:
    server = grpc.server(ThreadPoolExecutor(4))
    port = server.add_insecure_port(f"{cluster.net.host_address}:0")
    yield server, f"{cluster.net.host_address}:{port}"
    server.stop(None)


def test_other_blocks_under_asked_hashes_are_refused(
    cluster: Cluster, liar_server: tuple[grpc.Server, str]
) -> None:
    """Scenario: node 0 holds blocks A. A token holder (the liar) joins the
    metaserver advertising blocks B, which nobody holds, at an endpoint whose
    transfer engine is node 0's; a Pin of B it answers with node 0's real pin
    of A: A's slots and A's true checksums. Node 1 queries B: before the fix
    it read A's bytes, found them matching, and served them as B (8 blocks
    of wrong bytes); now every block fails its key-bound checksum, none is
    published, and the 8 are counted as `checksum`."""
    owner = cluster.engine(0, "redirect-a", 31)
    other = block_hashes("redirect-a", 8)
    assert owner.call("save", block_ids=list(range(8)), hashes=other)["stored"] == 8
    indexed(cluster, 0, other, SHAPE_BLOCK_BYTES)
    asked = block_hashes("redirect-b", 8)
    digest = namespace_digest(cluster, 0, SHAPE_BLOCK_BYTES)
    node0 = cluster.remote(0)["endpoint"]  # rpc=H:P;te=H:P
    te = dict(p.split("=", 1) for p in node0.split(";"))["te"]
    server, addr = liar_server
    liar = Redirecting(
        cluster.servers[0].addr,
        b"".join(bytes.fromhex(h) for h in asked),
        b"".join(bytes.fromhex(h) for h in other),
    )
    pb_grpc.add_PeerServicer_to_server(liar, server)
    server.start()
    # Started first: the liar sends no heartbeats, and the metaserver drops
    # it as stale 6 s after its join.
    reader = cluster.engine(1, "redirect-b", 32)
    meta = MetaClient(cluster.meta_addr, "liar", time.time_ns(), token=TOKEN)
    try:
        meta.join(f"rpc={addr};te={te}")
        meta.insert(digest, [bytes.fromhex(h) for h in asked])
        was = cluster.remote(1)
        got = reader.call("query", hashes=asked, wait_s=20)
        now = cluster.remote(1)
        assert liar.pins >= 1, ("the reader never asked the liar", got, now)
        assert got["num_blocks"] == 0 and not got["loading"], got
        checksum = now["failed_blocks"]["checksum"] - was["failed_blocks"]["checksum"]
        assert checksum == 8, now
        assert now["fetched_blocks"] == was["fetched_blocks"], now
        # Not published: node 1's L1 would answer a query of B by itself.
        with contextlib.suppress(grpc.RpcError):  # gone as stale already
            meta.leave()
        again = reader.call("query", hashes=asked, wait_s=10)
        assert again["num_blocks"] == 0, again
    finally:
        meta.close()
        liar.close()
