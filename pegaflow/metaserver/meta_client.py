"""A node's side of the metaserver: one synchronous channel, every call with a
deadline and the shared token. Failed calls raise grpc.RpcError as gRPC made
it: the caller reads .code() (FAILED_PRECONDITION "unknown incarnation":
join and re-send everything held; see docs/metaserver.md)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pegaflow.common import peer_auth
from pegaflow.common.channels import channel_options
from pegaflow.proto import metaserver_pb2 as pb
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc

from .directory import Segment
from .meta_config import MAX_MESSAGE_BYTES


@dataclass(frozen=True, slots=True)
class JoinTerms:
    heartbeat_interval_s: float
    node_stale_s: float
    max_batch_hashes: int
    ttl_s: int


class MetaClient:
    def __init__(
        self,
        addr: str,
        node_id: str = "",
        incarnation: int = 0,
        token: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.addr = addr.removeprefix("http://")
        self.node = pb.NodeRef(node_id=node_id, incarnation=incarnation)
        self.timeout_s = timeout_s
        self._metadata = peer_auth.metadata(token)
        self._channel = grpc.insecure_channel(
            self.addr, options=channel_options(MAX_MESSAGE_BYTES)
        )
        self.stub = pb_grpc.MetaServerStub(self._channel)

    def call(self, method: str, request: object) -> object:
        """Any RPC by name, with this client's deadline and token."""
        return getattr(self.stub, method)(
            request, timeout=self.timeout_s, metadata=self._metadata
        )

    def join(self, endpoint: str) -> JoinTerms:
        got = self.call("Join", pb.JoinRequest(node=self.node, endpoint=endpoint))
        return JoinTerms(
            got.heartbeat_interval_ms / 1000,
            got.node_stale_ms / 1000,
            got.max_batch_hashes,
            got.ttl_s,
        )

    def heartbeat(self) -> int:
        return self.call("Heartbeat", pb.HeartbeatRequest(node=self.node)).entries

    def insert(self, namespace: bytes, hashes: list[bytes]) -> tuple[int, int]:
        got = self.call(
            "Insert", pb.InsertRequest(node=self.node, blocks=pack(namespace, hashes))
        )
        return got.inserted, got.refreshed

    def remove(self, namespace: bytes, hashes: list[bytes]) -> int:
        got = self.call(
            "Remove", pb.RemoveRequest(node=self.node, blocks=pack(namespace, hashes))
        )
        return got.removed

    def query(self, namespace: bytes, hashes: list[bytes]) -> list[Segment]:
        got = self.call(
            "QueryPrefix",
            pb.QueryPrefixRequest(
                blocks=pack(namespace, hashes), asker_node_id=self.node.node_id
            ),
        )
        return [
            Segment(s.node_id, s.incarnation, s.endpoint, s.blocks)
            for s in got.segments
        ]

    def leave(self) -> int:
        return self.call("Leave", pb.LeaveRequest(node=self.node)).removed

    def close(self) -> None:
        self._channel.close()


def pack(namespace: bytes, hashes: list[bytes]) -> pb.Blocks:
    """hashes must all have one length."""
    hash_len = len(hashes[0]) if hashes else 1
    return pb.Blocks(namespace=namespace, hash_len=hash_len, hashes=b"".join(hashes))
