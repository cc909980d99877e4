"""gRPC servicer: message -> engine call -> message. Errors become statuses in one
interceptor; the servicer itself never builds a status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import numpy as np

from pegaflow.cache.instances import Worker
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common import deadlines
from pegaflow.common.errors import InvalidRequest, PegaflowError, PermissionDenied
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.common.identity import CallContext, Caller, peer_on_host, tcp_peer
from pegaflow.common.socket_frames import load_item_error
from pegaflow.copiers.copier import CudaExport
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

from .engine import Engine
from .query_wire import QueryBody

logger = logging.getLogger(__name__)


SESSION_FIRST_PING_S = 10.0
ENGINE_METHODS = f"/{pb.DESCRIPTOR.services_by_name['PegaFlow'].full_name}/"
OPEN_METHODS = frozenset({"ServerInfo"})  # what any host may ask


# How long, and for how many messages, a refused stream is read before the
# refusal is sent.
REFUSED_STREAM_DRAIN_S = 1.0
REFUSED_STREAM_DRAIN_MESSAGES = 8


async def _drain(requests: AsyncIterator[object]) -> None:
    """Read what a refused stream's client sends first, until it half-closes
    or the bounds above end it. Refused before its ping was read, the stream
    ended while the client was still sending; ~7 % of such refusals reached
    a client as INTERNAL ("Internal error from Core") instead of
    PERMISSION_DENIED (tests/server/test_remote_callers.py), and a sync
    client's refused Session once hung past its deadline in CI."""

    async def read() -> None:
        count = 0
        async for _ in requests:
            count += 1
            if count >= REFUSED_STREAM_DRAIN_MESSAGES:
                return

    # A client that keeps its stream open, or one gone already: refused now.
    with contextlib.suppress(asyncio.TimeoutError, grpc.RpcError):
        await asyncio.wait_for(read(), REFUSED_STREAM_DRAIN_S)


class LocalEngines(grpc.aio.ServerInterceptor):
    """Engine RPCs only from callers the kernel places on this host (loopback,
    or a socket of this network namespace from one of its own addresses),
    unless allow_remote. With a routable --addr (peers on) any host could
    otherwise query an instance's cache (a cached prompt is a secret) and
    take leases up to its cap, or hold Session streams open. An engine's
    memory is reachable from its own host only (CUDA IPC, process_vm_*), so
    a remote engine has nothing to register anyway. `port` is the bound one."""

    def __init__(self, allow_remote: bool) -> None:
        self.allow_remote = allow_remote
        self.port = 0
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # one per method

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        if (
            handler is None
            or self.allow_remote
            or not details.method.startswith(ENGINE_METHODS)
            or method in OPEN_METHODS
        ):
            return handler
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            wrapped = self._wrapped[details.method] = self._wrap(method, handler)
        return wrapped

    def _wrap(
        self, method: str, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def checked(
                request: object, context: grpc.aio.ServicerContext
            ) -> object:
                self._check(method, context.peer())
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                checked,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:  # WatchBlocks
            inner_out = handler.unary_stream

            async def checked_out(
                request: object, context: grpc.aio.ServicerContext
            ) -> None:
                try:
                    self._check(method, context.peer())
                except PegaflowError as exc:  # refused, or no lookup now
                    await context.abort(exc.code, str(exc))
                await inner_out(request, context)

            return grpc.unary_stream_rpc_method_handler(
                checked_out,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def checked_stream(
                requests: AsyncIterator[object], context: grpc.aio.ServicerContext
            ) -> AsyncIterator[object]:
                try:
                    self._check(method, context.peer())
                except PegaflowError as exc:  # refused, or no lookup now
                    await _drain(requests)
                    await context.abort(exc.code, str(exc))
                async for reply in inner_stream(requests, context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(
                checked_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _check(self, method: str, peer: str) -> None:
        if not peer_on_host(peer, self.port):
            raise PermissionDenied(
                f"{method}: refused for {peer}: engine RPCs are served to "
                "processes of this host only (the unix socket, loopback, or "
                "this host's own address); start the server with "
                "--allow-remote-engines to accept other hosts"
            )


def _ids(values: object, field: str) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def spec_from_message(req: pb.RegisterInstanceRequest) -> RegisterSpec:
    kinds = {r.WhichOneof("kind") for r in req.regions}
    if None in kinds or len(kinds) > 1:
        raise InvalidRequest("regions: each needs host or cuda, all of one kind")
    kind = kinds.pop() if kinds else "host"
    if kind == "host":
        pids = {r.host.pid for r in req.regions}
        if len(pids) > 1:
            raise InvalidRequest("regions: host regions of several pids")
        pid = pids.pop() if pids else 0
        if pid <= 0 and req.regions:
            raise InvalidRequest("regions[0].host.pid: must be > 0")
        regions = tuple((r.host.address, r.host.size) for r in req.regions)
    else:
        pid = 0
        regions = tuple((r.cuda.offset, r.cuda.size) for r in req.regions)
    cuda = _cuda_export(req) if kind == "cuda" else None
    if cuda is None and req.event_handles:
        raise InvalidRequest("event_handles: only cuda regions have events")
    layers = tuple(
        LayerLayout(
            layer.region_index,
            layer.offset,
            layer.num_blocks,
            layer.block_stride,
            tuple(Segment(s.offset, s.size) for s in layer.segments),
        )
        for layer in req.layers
    )
    return RegisterSpec(
        req.instance_id,
        req.namespace,
        req.tp_rank,
        req.tp_size,
        req.world_size,
        req.device,
        kind,
        pid,
        regions,
        layers,
        cuda,
        req.replicated,
        _layer_signals(req),
        req.owner_token,
    )


def _layer_signals(req: pb.RegisterInstanceRequest) -> tuple[int, int] | None:
    if not req.HasField("layer_signals"):
        return None
    return (req.layer_signals.pid, req.layer_signals.address)


def _cuda_export(req: pb.RegisterInstanceRequest) -> CudaExport:
    uuids = {r.cuda.device_uuid for r in req.regions}
    if len(uuids) > 1:
        raise InvalidRequest("regions: cuda regions of several devices")
    return CudaExport(
        tuple(r.cuda.ipc_handle for r in req.regions),
        uuids.pop(),
        tuple(req.event_handles),
    )


def register_response(
    worker: Worker, server_pid: int, socket_path: str
) -> pb.RegisterInstanceResponse:
    """The one answer to a registration, whichever transport carried it."""
    return pb.RegisterInstanceResponse(
        server_pid=server_pid,
        slot_bytes=worker.geometry.slot_bytes,
        query_socket=socket_path,
        owner_token=worker.owner_token,
    )


_TCP = Caller("tcp")  # a TCP caller nobody looked up


def _grpc_context(
    owner_token: bytes,
    deadline_ns: int,
    context: grpc.aio.ServicerContext,
    caller: Caller = _TCP,
) -> CallContext:
    """Over TCP the caller is unknown unless looked up (a loopback peer's
    uid): its owner token is its proof. The deadline is the earlier of the
    request's own and gRPC's."""
    remaining = context.time_remaining()
    grpc_deadline = None if remaining is None else time.monotonic() + remaining
    deadline = deadlines.earliest(deadlines.from_wire(deadline_ns), grpc_deadline)
    return CallContext(caller, owner_token, deadline)


class PegaFlowServicer(pb_grpc.PegaFlowServicer):
    def __init__(
        self, engine: Engine, server_pid: int, server_id: bytes, port: int = 0
    ) -> None:
        self._engine = engine
        self._pid = server_pid
        self.server_id = server_id
        self.port = port  # the bound gRPC port: finds loopback callers' uids
        self.socket_path = ""  # set once the unix socket listens

    async def ServerInfo(
        self, req: pb.ServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfoResponse:
        from pegaflow.common.socket_frames import PROTOCOL_VERSION

        return pb.ServerInfoResponse(
            server_pid=self._pid,
            socket_path=self.socket_path,
            socket_protocol=PROTOCOL_VERSION,
            server_id=self.server_id,
        )

    async def RegisterInstance(
        self, req: pb.RegisterInstanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterInstanceResponse:
        caller = tcp_peer(context.peer(), self.port)
        spec = spec_from_message(req)
        worker = await self._engine.register_when_ready(spec, caller)
        return register_response(worker, self._pid, self.socket_path)

    async def Save(
        self, req: pb.SaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.SaveResponse:
        layer_ids = _ids(req.layer_ids, "layer_ids") if req.layer_ids else None
        res = await self._engine.save(
            req.instance_id,
            req.tp_rank,
            _ids(req.block_ids, "block_ids"),
            list(req.block_hashes),
            layer_ids,
            req.wait_event,
            _grpc_context(req.owner_token, req.deadline_ns, context),
        )
        return pb.SaveResponse(
            stored=res.stored, deduplicated=res.deduplicated, rejected=res.rejected
        )

    async def QueryPrefix(
        self, req: QueryBody, context: grpc.aio.ServicerContext
    ) -> pb.QueryPrefixResponse:
        # No owner token (vLLM's scheduler asks for its workers), but a
        # loopback caller the kernel names must run as the instance's user,
        # as on the unix socket: another user's queries would probe and lease
        # (up to the instance's lease cap) what that instance has cached.
        # req: pegaflow.server.query_wire's, its hashes built once admitted.
        ctx = _grpc_context(b"", 0, context, tcp_peer(context.peer(), self.port))
        self._engine.queries.admit(req.instance_id, req.count, ctx)
        res = self._engine.query(req.instance_id, req.hashes(), None, ctx)
        if res.pending is not None:
            res = await res.pending()
        if res.loading:
            return pb.QueryPrefixResponse(
                loading=pb.QueryPrefixResponse.Loading(
                    num_blocks=res.num_blocks,
                    ready_blocks=res.ready_blocks,
                    l1_gbps=res.l1_gbps,
                    tier_gbps=res.tier_gbps,
                )
            )
        return pb.QueryPrefixResponse(
            ready=pb.QueryPrefixResponse.Ready(
                num_blocks=res.num_blocks,
                lease_id=res.lease_id,
                lease_ttl_s=res.lease_ttl_s,
                l1_gbps=res.l1_gbps,
            )
        )

    async def Load(
        self, req: pb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadResponse:
        ctx = _grpc_context(req.owner_token, req.deadline_ns, context)
        if not req.items:  # the original form: one lease
            item = (req.lease_id, req.lease_offset, _ids(req.block_ids, "block_ids"))
            res = await self._engine.load(
                req.instance_id, req.tp_rank, [item], False, req.layer_seq, ctx
            )
            return pb.LoadResponse(loaded=res.loaded, bytes=res.bytes)
        if req.lease_id or req.lease_offset or req.block_ids:
            raise InvalidRequest(
                "items: set either items or lease_id/lease_offset/block_ids, not both"
            )
        items = [
            (it.lease_id, it.lease_offset, _ids(it.block_ids, "block_ids"))
            for it in req.items
        ]
        res = await self._engine.load(
            req.instance_id, req.tp_rank, items, True, req.layer_seq, ctx
        )
        return pb.LoadResponse(
            loaded=res.loaded,
            bytes=res.bytes,
            items=[
                pb.LoadItemResult(
                    loaded=r.loaded,
                    bytes=r.bytes,
                    error=load_item_error(r.error).decode(),  # as the socket's
                )
                for r in res.items
            ],
        )

    async def ReleaseLease(
        self, req: pb.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeaseResponse:
        self._engine.release_lease(req.lease_id)
        return pb.ReleaseLeaseResponse()

    async def Unregister(
        self, req: pb.UnregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterResponse:
        ctx = CallContext(Caller("tcp"), req.owner_token)
        self._engine.unregister(req.instance_id, req.tp_rank, ctx)
        return pb.UnregisterResponse()

    async def Session(
        self,
        requests: AsyncIterator[pb.SessionPing],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.SessionPong]:
        try:
            # An idle stream holds one of --max-concurrent-rpcs until it says
            # who it is: a client that never does must not keep it.
            first = await asyncio.wait_for(anext(requests, None), SESSION_FIRST_PING_S)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"session: no first ping within {SESSION_FIRST_PING_S:g} s",
            )
        if first is None:
            return
        try:
            worker = self._engine.registry.owned_worker(
                first.instance_id, first.tp_rank, Caller("tcp"), first.owner_token
            )
        except PegaflowError as exc:
            await context.abort(exc.code, str(exc))
        try:
            yield pb.SessionPong(server_time_ns=time.time_ns())
            async for _ in requests:
                yield pb.SessionPong(server_time_ns=time.time_ns())
        finally:
            self._drop_if_current(worker)

    async def WatchBlocks(
        self, req: pb.WatchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """The instance's namespace's block events (pegaflow.server.block_events),
        written until the client goes. Authorised as QueryPrefix: vLLM's
        scheduler, which holds no owner token, asks."""
        hub = self._engine.block_events
        ctx = _grpc_context(b"", 0, context, tcp_peer(context.peer(), self.port))
        try:
            watcher = hub.watch(req.instance_id, ctx)
        except PegaflowError as exc:
            await context.abort(exc.code, str(exc))
        try:
            await hub.serve(watcher, context.write)
        except PegaflowError as exc:
            await context.abort(exc.code, str(exc))

    def _drop_if_current(self, worker: Worker) -> None:
        """The stream ended: forget the worker unless it re-registered meanwhile."""
        registry = self._engine.registry
        inst = registry.instances.get(worker.instance_id)
        if inst is not None and inst.workers.get(worker.tp_rank) is worker:
            logger.info(
                "session of %s rank %d closed; dropping its registration",
                worker.instance_id,
                worker.tp_rank,
            )
            self._engine.unregister(worker.instance_id, worker.tp_rank)
