"""gRPC's one interceptor for errors and request bodies: every unary RPC goes
through pegaflow.daemon.boundary (errors become statuses, a bug INTERNAL, each
call timed), large bodies are charged to one RequestBytesBudget before they are
parsed (pegaflow.common.request_limits), QueryPrefix is read off its bytes
(pegaflow.server.query_wire) and the heap is trimmed after large requests
(pegaflow.daemon.memory_trim)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from pegaflow.common.errors import PegaflowError
from pegaflow.common.request_limits import (
    LARGE_BODY_BYTES,
    MAX_REQUEST_BYTES_IN_FLIGHT,
    RequestBytesBudget,
)
from pegaflow.daemon.boundary import Undecodable, guarded, lenient, undecodable
from pegaflow.daemon.memory_trim import HeapTrimmer
from pegaflow.proto import pegaflow_pb2 as pb

from .metrics import Metrics
from .query_wire import decode_query

_ENDS_CALL = (grpc.aio.AbortError,)  # a handler's own context.abort()
_SERVICE = f"/{pb.DESCRIPTOR.services_by_name['PegaFlow'].full_name}/"
# Requests read off their bytes instead of parsed whole by protobuf.
_DECODERS: dict[str, Callable[[bytes], object]] = {
    _SERVICE + "QueryPrefix": decode_query
}


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Every unary RPC through pegaflow.daemon.boundary: errors become statuses, a bug
    INTERNAL, and each call is timed. Large bodies share one RequestBytesBudget
    (refused before they are parsed once it is spent) and the heap is trimmed
    after them (pegaflow.daemon.memory_trim)."""

    def __init__(
        self, metrics: Metrics, max_request_bytes: int = MAX_REQUEST_BYTES_IN_FLIGHT
    ) -> None:
        self._metrics = metrics
        self.budget = RequestBytesBudget(max_request_bytes)
        self.trimmer = HeapTrimmer()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = details.method.rsplit("/", 1)[-1]
        metrics, trimmer = self._metrics, self.trimmer
        parse = _DECODERS.get(details.method, handler.request_deserializer)

        async def bounded(request: object, context: grpc.aio.ServicerContext) -> object:
            charge = request if isinstance(request, _Charged) else None
            if charge is not None:
                request = charge.request
            if isinstance(request, Undecodable):
                work = _raise(undecodable(method, request))
            elif isinstance(request, PegaflowError):  # refused before parsing
                work = _raise(request)
            else:
                work = inner(request, context)
            try:
                got = await guarded(metrics, method, "grpc", work, _ENDS_CALL)
            finally:
                if charge is not None:
                    charge.release()
                    trimmer.note(charge.nbytes)
            if isinstance(got, PegaflowError):
                # Not context.abort(): its AbortError leaves the call's state,
                # request included, in a reference cycle (grpc's RPCState and
                # the error's traceback) that only the cyclic GC frees; 64
                # refused 8 MiB queries held ~300 MiB that way.
                context.set_code(got.code)
                context.set_details(str(got))
                return None
            return got

        return grpc.unary_unary_rpc_method_handler(
            bounded,
            request_deserializer=_charged(lenient(parse), self.budget),
            response_serializer=_or_empty(handler.response_serializer),
        )


def _or_empty(
    serialize: Callable[[object], bytes] | None,
) -> Callable[[object], bytes] | None:
    """The method's serializer; None (an error's answer) as no bytes."""
    if serialize is None:
        return None
    return lambda response: b"" if response is None else serialize(response)


class _Charged:
    """A large body's request and its charge on the budget, given back once
    answered (or, if the call ended before its handler ran, when dropped)."""

    __slots__ = ("request", "nbytes", "_budget")

    def __init__(
        self, request: object, nbytes: int, budget: RequestBytesBudget
    ) -> None:
        self.request, self.nbytes, self._budget = request, nbytes, budget

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give(self.nbytes)

    def __del__(self) -> None:
        self.release()


def _charged(
    parse: Callable[[bytes], object], budget: RequestBytesBudget
) -> Callable[[bytes], object]:
    """A deserializer charging large bodies to the budget before parsing them
    (a refused one is never parsed)."""

    def charged(data: bytes) -> object:
        if len(data) < LARGE_BODY_BYTES:
            return parse(data)
        refused = budget.take(len(data))
        if refused is not None:
            return _Charged(refused, 0, budget)
        return _Charged(parse(data), len(data), budget)

    return charged


async def _raise(error: PegaflowError) -> object:
    raise error
