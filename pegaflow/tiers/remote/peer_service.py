"""The Peer gRPC service (proto/peer.proto) on the owner's server port: Pin and
Release for readers on other nodes. Errors become statuses in the server's one
interceptor (pegaflow.server.grpc_service.ErrorInterceptor), like every other RPC."""

from __future__ import annotations

import grpc

from pegaflow.common import peer_auth
from pegaflow.common.errors import InvalidRequest
from pegaflow.common.keys import MAX_HASH_BYTES, PackedHashes
from pegaflow.proto import peer_pb2 as pb
from pegaflow.proto import peer_pb2_grpc as pb_grpc

from .pins import PinTable
from .remote_metrics import RemoteMetrics

MAX_PIN_HASHES = 65536
MAX_NAMESPACE_BYTES = 64


class PeerServicer(pb_grpc.PeerServicer):
    def __init__(
        self,
        pins: PinTable,
        namespaces: object,
        token: str | None,
        incarnation: int,
        metrics: RemoteMetrics,
    ) -> None:
        """namespaces: digest -> Namespace of the blocks this node advertises."""
        self._pins = pins
        self._metrics = metrics
        self._namespaces = namespaces
        self._token = token
        self._incarnation = incarnation

    async def Pin(
        self, req: pb.PinRequest, context: grpc.aio.ServicerContext
    ) -> pb.PinResponse:
        peer_auth.require(context, self._token)
        if not 1 <= len(req.namespace) <= MAX_NAMESPACE_BYTES:
            raise InvalidRequest(f"namespace: need 1..{MAX_NAMESPACE_BYTES} bytes")
        if not 1 <= req.hash_len <= MAX_HASH_BYTES:
            raise InvalidRequest(f"hash_len: {req.hash_len}, need 1..{MAX_HASH_BYTES}")
        count, extra = divmod(len(req.hashes), req.hash_len)
        if extra or not 0 < count <= MAX_PIN_HASHES:
            raise InvalidRequest(
                f"hashes: {len(req.hashes)} bytes is not 1..{MAX_PIN_HASHES} "
                f"hashes of {req.hash_len} bytes"
            )
        ns = self._namespaces.get(req.namespace)
        empty = pb.PinResponse(incarnation=self._incarnation)
        if ns is None:
            return empty  # nothing of that namespace here (any more)
        if (req.slot_bytes, req.shards) != (ns.slot_bytes, ns.tp_size):
            # Same digest, other geometry: nothing is pinned, and the answer
            # says ours, so the reader counts it as a geometry mismatch.
            return pb.PinResponse(
                slot_bytes=ns.slot_bytes, shards=ns.tp_size,
                incarnation=self._incarnation,
            )  # fmt: skip
        got = await self._pins.pin(
            ns,
            PackedHashes(req.hashes, req.hash_len, count),
            req.hold_ms / 1000,
            caller_host(context.peer()),
        )
        if not got.pin_id:
            return empty
        self._metrics.served_blocks.inc(len(got.slots))
        self._metrics.pins.set(len(self._pins))
        sums = b"" if got.checksums is None else got.checksums.astype("<u8").tobytes()
        return pb.PinResponse(
            pin_id=got.pin_id,
            blocks=len(got.slots),
            slot_addrs=got.slots.astype("<u8").tobytes(),
            checksums=sums,
            hold_ms=int(got.hold_s * 1000),
            slot_bytes=ns.slot_bytes,
            shards=ns.tp_size,
            incarnation=self._incarnation,
        )

    async def Checksums(
        self, req: pb.ChecksumsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChecksumsResponse:
        peer_auth.require(context, self._token)
        sums = await self._pins.checksums(req.pin_id, caller_host(context.peer()))
        raw = b"" if sums is None else sums.astype("<u8").tobytes()
        return pb.ChecksumsResponse(checksums=raw)

    async def Release(
        self, req: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        peer_auth.require(context, self._token)
        released = self._pins.release(req.pin_id, caller_host(context.peer()))
        return pb.ReleaseResponse(released=released)


def caller_host(peer: str) -> str:
    """grpc's name of the caller ("ipv4:10.0.0.5:43210") without its port: a
    reader's Pin, Checksums and Release may come on different connections."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return f"{scheme}:{rest.rpartition(':')[0]}"
    return peer
