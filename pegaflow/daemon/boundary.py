"""The one place a request's outcome becomes a status, for both servers.

gRPC's interceptor and the unix-socket server call `guarded` (or, for the
socket's inline queries, `guarded_sync`): a PegaflowError is the client's
status as it is (INVALID_ARGUMENT naming the field, ...); anything else is a
bug of ours, logged with its traceback and reported as INTERNAL naming only
the method; every request is timed under (method, code, transport).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol, TypeVar

from prometheus_client import Histogram

from pegaflow.common.errors import InternalError, InvalidRequest, PegaflowError


class RpcMetrics(Protocol):
    """What a daemon's metrics hold for the boundary (the server's and the
    metaserver's both): the RPC histogram and its children by labels."""

    rpc_seconds: Histogram
    rpc_timers: dict[tuple[str, str, str], Histogram]


logger = logging.getLogger(__name__)

T = TypeVar("T")
Transport = Literal["grpc", "unix"]


def _observe(
    metrics: RpcMetrics, method: str, code: str, transport: str, seconds: float
) -> None:
    """Histogram children cached: labels() per request costs more than a
    socket query's own work does."""
    key = (method, code, transport)
    timer = metrics.rpc_timers.get(key)
    if timer is None:
        timer = metrics.rpc_timers[key] = metrics.rpc_seconds.labels(*key)
    timer.observe(seconds)


class Undecodable:
    """A request body that is not the method's message: what `lenient`'s
    deserializer hands the method instead of raising, for `undecodable` to
    answer. grpc answers a raising deserializer UNKNOWN and logs a traceback
    for each such call."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def lenient(parse: Callable[[bytes], T] | None) -> Callable[[bytes], T | Undecodable]:
    """A request deserializer that never raises: a body that does not parse
    (any client can send any bytes) becomes an Undecodable."""
    if parse is None:  # raw bytes: nothing to parse
        return lambda data: data

    def safe(data: bytes) -> T | Undecodable:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or worse: the client's bytes
            return Undecodable(f"{type(exc).__name__}: {exc}")

    return safe


def undecodable(method: str, request: Undecodable) -> InvalidRequest:
    """The answer to a body that did not parse, naming the request."""
    return InvalidRequest(f"request: not a valid {method} request ({request.why})")


def _status(method: str, exc: Exception) -> PegaflowError:
    if isinstance(exc, PegaflowError):
        logger.debug("%s -> %s: %s", method, exc.code.name, exc)
        # An answer now, not a raised error: its traceback held the frames
        # that hold it (and the request they were working on) in a cycle,
        # which only the cyclic GC frees, and gc_freeze may never.
        return exc.with_traceback(None)
    logger.error("%s failed", method, exc_info=exc)
    return InternalError(f"{method}: internal error")


async def guarded(
    metrics: RpcMetrics,
    method: str,
    transport: Transport,
    work: Awaitable[T],
    passthrough: tuple[type[BaseException], ...] = (),
) -> T | PegaflowError:
    """The result of `work`, or the error to answer with. A cancelled call
    (its client went away) and `passthrough` exceptions (the transport's own
    way of ending a call) are counted and re-raised."""
    start, code = time.perf_counter(), "OK"
    try:
        return await work
    except (asyncio.CancelledError, *passthrough):
        code = "CANCELLED"
        raise
    except Exception as exc:
        err = _status(method, exc)
        code = err.code.name
        return err
    finally:
        _observe(metrics, method, code, transport, time.perf_counter() - start)


def guarded_sync(
    metrics: RpcMetrics, method: str, transport: Transport, work: Callable[[], T]
) -> T | PegaflowError:
    """guarded() for work answered without leaving the event loop's callback."""
    start, code = time.perf_counter(), "OK"
    try:
        return work()
    except Exception as exc:
        err = _status(method, exc)
        code = err.code.name
        return err
    finally:
        _observe(metrics, method, code, transport, time.perf_counter() - start)
