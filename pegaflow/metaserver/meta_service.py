"""gRPC servicer: message -> checked values -> Directory -> message, and the
one interceptor that checks the shared token and turns errors into statuses
(through pegaflow.daemon.boundary, as the server's does)."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from pegaflow.common import peer_auth
from pegaflow.common.errors import InvalidRequest, PegaflowError
from pegaflow.common.keys import MAX_HASH_BYTES, NamespaceDigest, PackedHashes
from pegaflow.daemon.boundary import Undecodable, guarded_sync, lenient, undecodable
from pegaflow.proto import metaserver_pb2 as pb
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc

from .directory import Directory
from .meta_config import (
    MAX_BATCH_HASHES,
    MAX_ENDPOINT_BYTES,
    MAX_NAMESPACE_BYTES,
    MAX_NODE_ID_BYTES,
)
from .meta_metrics import MetaMetrics

MAX_INCARNATION_AHEAD_NS = 3600 * 10**9


def check_text(field: str, text: str, limit: int, empty_ok: bool = False) -> str:
    """A node id or endpoint: printable ASCII without spaces, 1..limit bytes
    (they are logged and handed to other nodes as they are)."""
    if not text and empty_ok:
        return text
    if not 1 <= len(text) <= limit:
        raise InvalidRequest(f"{field}: {len(text)} characters, need 1..{limit}")
    if not (text.isascii() and text.isprintable()) or " " in text:
        raise InvalidRequest(f"{field}: only printable ASCII without spaces")
    return text


def node_ref(ref: pb.NodeRef) -> tuple[str, int]:
    node_id = check_text("node.node_id", ref.node_id, MAX_NODE_ID_BYTES)
    if ref.incarnation == 0:
        raise InvalidRequest("node.incarnation: must be > 0")
    # Servers take their start time in ns: one far ahead of our clock would
    # fence the node's every later incarnation (a token holder posing as it).
    if ref.incarnation > time.time_ns() + MAX_INCARNATION_AHEAD_NS:
        raise InvalidRequest(
            "node.incarnation: more than an hour ahead of this metaserver's "
            "clock (servers use their start time in ns; check the clocks)"
        )
    return node_id, ref.incarnation


def blocks(msg: pb.Blocks) -> tuple[NamespaceDigest, PackedHashes]:
    if not 1 <= len(msg.namespace) <= MAX_NAMESPACE_BYTES:
        raise InvalidRequest(
            f"blocks.namespace: {len(msg.namespace)} bytes, "
            f"need 1..{MAX_NAMESPACE_BYTES}"
        )
    hash_len, size = msg.hash_len, len(msg.hashes)
    if not 1 <= hash_len <= MAX_HASH_BYTES:
        raise InvalidRequest(f"blocks.hash_len: {hash_len}, need 1..{MAX_HASH_BYTES}")
    if size % hash_len:
        raise InvalidRequest(
            f"blocks.hashes: {size} bytes is not a multiple of hash_len {hash_len}"
        )
    if size // hash_len > MAX_BATCH_HASHES:
        raise InvalidRequest(
            f"blocks.hashes: {size // hash_len} hashes, the most is {MAX_BATCH_HASHES}"
        )
    # As they came: the index probes the packed buffer, no object per hash.
    return msg.namespace, PackedHashes(msg.hashes, hash_len, size // hash_len)


class MetaServicer(pb_grpc.MetaServerServicer):
    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    def Join(  # noqa: N802 - gRPC's method names
        self, request: pb.JoinRequest, context: grpc.ServicerContext
    ) -> pb.JoinResponse:
        node_id, incarnation = node_ref(request.node)
        endpoint = check_text("endpoint", request.endpoint, MAX_ENDPOINT_BYTES)
        self.directory.join(node_id, incarnation, endpoint)
        config = self.directory.config
        return pb.JoinResponse(
            heartbeat_interval_ms=int(config.heartbeat_interval_s * 1000),
            node_stale_ms=int(config.node_stale_s * 1000),
            max_batch_hashes=MAX_BATCH_HASHES,
            ttl_s=int(config.ttl_s),
        )

    def Heartbeat(  # noqa: N802
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        entries = self.directory.heartbeat(*node_ref(request.node))
        return pb.HeartbeatResponse(entries=entries)

    def Insert(  # noqa: N802
        self, request: pb.InsertRequest, context: grpc.ServicerContext
    ) -> pb.InsertResponse:
        node = node_ref(request.node)
        inserted, refreshed = self.directory.insert(*node, *blocks(request.blocks))
        return pb.InsertResponse(inserted=inserted, refreshed=refreshed)

    def Remove(  # noqa: N802
        self, request: pb.RemoveRequest, context: grpc.ServicerContext
    ) -> pb.RemoveResponse:
        node = node_ref(request.node)
        return pb.RemoveResponse(
            removed=self.directory.remove(*node, *blocks(request.blocks))
        )

    def QueryPrefix(  # noqa: N802
        self, request: pb.QueryPrefixRequest, context: grpc.ServicerContext
    ) -> pb.QueryPrefixResponse:
        asker = check_text(
            "asker_node_id", request.asker_node_id, MAX_NODE_ID_BYTES, empty_ok=True
        )
        segments = self.directory.query(*blocks(request.blocks), asker)
        return pb.QueryPrefixResponse(
            segments=[
                pb.Segment(
                    node_id=s.node_id,
                    incarnation=s.incarnation,
                    endpoint=s.endpoint,
                    blocks=s.blocks,
                )
                for s in segments
            ],
            matched=sum(s.blocks for s in segments),
        )

    def Leave(  # noqa: N802
        self, request: pb.LeaveRequest, context: grpc.ServicerContext
    ) -> pb.LeaveResponse:
        return pb.LeaveResponse(removed=self.directory.leave(*node_ref(request.node)))


class MetaInterceptor(grpc.ServerInterceptor):
    """Every RPC (health included) needs the shared token when one is set;
    unary RPCs then run through pegaflow.daemon.boundary (errors become statuses, a
    bug INTERNAL, each call timed)."""

    def __init__(self, metrics: MetaMetrics, token: str | None) -> None:
        self._metrics = metrics
        self._token = token.encode() if token is not None else None
        # One wrapped handler per method, made on its first call: building
        # one per call cost a few per cent of an empty call.
        self._bounded: dict[str, grpc.RpcMethodHandler] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(details)
        if handler is None:
            return handler
        if handler.unary_unary is None:  # health's Watch: refused or as it is
            refused = peer_auth.refusal(self._token, details.invocation_metadata)
            return handler if refused is None else _refusing(handler, refused)
        bounded = self._bounded.get(details.method)
        if bounded is None:
            bounded = self._bounded[details.method] = self._bound(details, handler)
        return bounded

    def _bound(
        self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        method = details.method.rsplit("/", 1)[-1]
        inner, metrics, token = handler.unary_unary, self._metrics, self._token

        def work(request: object, context: grpc.ServicerContext) -> object:
            refused = peer_auth.refusal(token, context.invocation_metadata())
            if refused is not None:
                raise peer_auth.Unauthenticated(refused)
            if isinstance(request, Undecodable):
                raise undecodable(method, request)
            return inner(request, context)

        def bounded(request: object, context: grpc.ServicerContext) -> object:
            got = guarded_sync(metrics, method, "grpc", lambda: work(request, context))
            if isinstance(got, PegaflowError):
                context.abort(got.code, str(got))  # raises: grpc ends the call
            return got

        return grpc.unary_unary_rpc_method_handler(
            bounded,
            request_deserializer=lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    def abort(request: object, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    return grpc.unary_stream_rpc_method_handler(
        abort,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
