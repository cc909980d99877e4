"""How an engine's requests reach the server: one Transport interface, carried
by the unix socket (pegaflow.client.socket_transport) or by gRPC (here).

A call is a frozen value built once by the client; each transport turns it into
its own wire form. A transport answers None when it cannot carry a request
(the socket's frames hold only equal-length hashes, u32 ids; it has no
connection), raises OSError when it broke (the client then tries the next),
and the typed errors of pegaflow.errors for the server's answers and for no
answer within `wait_s`.

What only gRPC carries (ServerInfo, ReleaseLease, Unregister, health, the
Session stream) is GrpcTransport's own methods, outside the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from pegaflow.common.channels import channel_options
from pegaflow.common.errors import PegaflowError, from_status
from pegaflow.common.keys import BlockHash, LoadSpec
from pegaflow.common.results import (
    LoadBatchResult,
    LoadItemResult,
    QueryResult,
    SaveResult,
)
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

from .session_stream import Session


@dataclass(frozen=True, slots=True)
class SaveCall:
    instance_id: str
    tp_rank: int
    block_ids: np.ndarray
    hashes: list[BlockHash]
    layer_ids: tuple[int, ...]
    wait_event: int
    token: bytes
    deadline_ns: int  # pegaflow.common.deadlines: no copy starts after it
    wait_s: float  # how long to wait for the answer (deadline + grace)


@dataclass(frozen=True, slots=True)
class QueryCall:
    instance_id: str
    hashes: list[BlockHash]
    hash_len: int | None  # every hash's length, when the caller vouches for it
    deadline_ns: int
    wait_s: float


@dataclass(frozen=True, slots=True)
class LoadCall:
    instance_id: str
    tp_rank: int
    items: Sequence[LoadSpec]
    batch: bool  # False: the original one-lease form (its errors raise)
    layer_seq: int
    token: bytes
    deadline_ns: int
    wait_s: float
    # An engine IPC event (1-based) the server records after the copy and
    # answers at once, the copy in flight; 0: it answers once the copy is done.
    # Over the unix socket only: gRPC's loads answer when done.
    done_event: int = 0


class Transport(Protocol):
    def register(
        self, request: pb.RegisterInstanceRequest, deadline_ns: int, wait_s: float
    ) -> pb.RegisterInstanceResponse | None: ...
    def save(self, call: SaveCall) -> SaveResult | None: ...
    def query(self, call: QueryCall) -> QueryResult | None: ...
    def load(self, call: LoadCall) -> LoadBatchResult | None: ...
    def close(self) -> None: ...


class GrpcTransport:
    """The reference transport: every request, from anywhere (gRPC's own
    deadline is the call's wait_s; the request carries its deadline too)."""

    def __init__(self, addr: str, max_message_bytes: int) -> None:
        self.channel = grpc.insecure_channel(
            addr, options=channel_options(max_message_bytes)
        )
        self.stub = pb_grpc.PegaFlowStub(self.channel)

    def call(self, method: str, request: object, timeout_s: float) -> object:
        try:
            return getattr(self.stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise from_status(exc.code(), exc.details() or "") from None

    def register(
        self, request: pb.RegisterInstanceRequest, deadline_ns: int, wait_s: float
    ) -> pb.RegisterInstanceResponse:
        return self.call("RegisterInstance", request, wait_s)

    def save(self, call: SaveCall) -> SaveResult:
        resp = self.call(
            "Save",
            pb.SaveRequest(
                instance_id=call.instance_id,
                tp_rank=call.tp_rank,
                block_ids=np.asarray(call.block_ids, np.uint32).tolist(),
                block_hashes=call.hashes,
                layer_ids=list(call.layer_ids),
                wait_event=call.wait_event,
                owner_token=call.token,
                deadline_ns=call.deadline_ns,
            ),
            call.wait_s,
        )
        return SaveResult(resp.stored, resp.deduplicated, resp.rejected)

    def query(self, call: QueryCall) -> QueryResult:
        request = pb.QueryPrefixRequest(
            instance_id=call.instance_id, block_hashes=call.hashes
        )
        resp = self.call("QueryPrefix", request, call.wait_s)
        if resp.WhichOneof("result") == "loading":
            pulling = resp.loading
            return QueryResult(
                pulling.num_blocks,
                0,
                loading=True,
                ready_blocks=pulling.ready_blocks,
                l1_gbps=pulling.l1_gbps,
                tier_gbps=pulling.tier_gbps,
            )
        ready = resp.ready
        return QueryResult(
            ready.num_blocks, ready.lease_id, ready.lease_ttl_s, l1_gbps=ready.l1_gbps
        )

    def load(self, call: LoadCall) -> LoadBatchResult:
        request = pb.LoadRequest(
            instance_id=call.instance_id,
            tp_rank=call.tp_rank,
            layer_seq=call.layer_seq,
            owner_token=call.token,
            deadline_ns=call.deadline_ns,
        )
        items = [
            (lease, offset, np.asarray(ids, np.uint32).tolist())
            for lease, offset, ids in call.items
        ]
        if call.batch:
            request.items.extend(
                pb.LoadItem(lease_id=lease, lease_offset=offset, block_ids=ids)
                for lease, offset, ids in items
            )
        else:
            ((request.lease_id, request.lease_offset, ids),) = items
            request.block_ids.extend(ids)
        resp = self.call("Load", request, call.wait_s)
        results = tuple(LoadItemResult(r.loaded, r.bytes, r.error) for r in resp.items)
        if call.batch and len(results) != len(call.items):
            raise PegaflowError(  # a server without batched loads
                f"Load: {len(results)} item results for {len(call.items)} items"
            )
        return LoadBatchResult(resp.loaded, resp.bytes, results)

    # -- gRPC only --------------------------------------------------------
    def server_info(self, timeout_s: float) -> pb.ServerInfoResponse:
        return self.call("ServerInfo", pb.ServerInfoRequest(), timeout_s)

    def release_lease(self, lease_id: int, timeout_s: float) -> None:
        self.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id), timeout_s)

    def unregister(
        self, instance_id: str, tp_rank: int, token: bytes, timeout_s: float
    ) -> None:
        request = pb.UnregisterRequest(
            instance_id=instance_id, tp_rank=tp_rank, owner_token=token
        )
        self.call("Unregister", request, timeout_s)

    def health(self, timeout_s: float) -> bool:
        """Whether the server's health service answers SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service="")
        try:
            resp = stub.Check(request, timeout=timeout_s)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def session(
        self, instance_id: str, tp_rank: int, interval_s: float, token: bytes
    ) -> Session:
        return Session(self.stub, instance_id, tp_rank, interval_s, token)

    def close(self) -> None:
        self.channel.close()
