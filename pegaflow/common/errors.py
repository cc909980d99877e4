"""Error hierarchy: each class maps to exactly one gRPC status code.

An expected "no" (a cache miss, an admission rejection) is a return value, never
one of these.
"""

from __future__ import annotations

import grpc


class PegaflowError(Exception):
    """Base class; `code` is the gRPC status the service answers with."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(PegaflowError, ValueError):
    """A field of a request is malformed; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownInstance(PegaflowError):
    """The instance (or its rank) is not registered, or went away."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotSupported(PegaflowError):
    """The server cannot serve this kind of request (e.g. GPU memory, no GPU)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class LeaseNotFound(PegaflowError):
    """The lease never existed, expired, or was fully consumed."""

    code = grpc.StatusCode.NOT_FOUND


class PoolExhausted(PegaflowError):
    """RESOURCE_EXHAUSTED: today only grpc's answer to an oversized message or
    to more concurrent RPCs than the server admits. A save the pool cannot
    take (all slots leased or in flight) is an expected "no" and comes back as
    SaveResult.rejected, not as this."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class CopyFailed(PegaflowError):
    """Moving bytes to or from an engine failed (process gone, memory unmapped)."""

    code = grpc.StatusCode.INTERNAL


class DeviceBroken(CopyFailed):
    """A GPU's CUDA context took a fault that CUDA never clears ("sticky"):
    every later call on it fails, until the server process restarts."""

    code = grpc.StatusCode.UNAVAILABLE


class InternalError(PegaflowError):
    """A bug of ours (an invariant the server itself should have kept), never
    the client's mistake: logged with its context, answered as INTERNAL."""

    code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(PegaflowError):
    """The request's deadline passed before its work could start."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(PegaflowError):
    """The caller may not do this: the kernel's word on who it is (or its owner
    token) does not match what the request claims."""

    code = grpc.StatusCode.PERMISSION_DENIED


class InstanceHeld(PegaflowError):
    """A live worker of this instance id and rank belongs to another process."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ProtocolMismatch(PegaflowError):
    """Client and server speak different versions of the socket's frames."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(PegaflowError):
    """A bound on a connection or on concurrent work was reached; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ServerUnavailable(PegaflowError):
    """Client side: the server could not be reached before the deadline."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[PegaflowError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        UnknownInstance,
        LeaseNotFound,
        PoolExhausted,
        PermissionDenied,
    )
}
_BY_CODE[grpc.StatusCode.UNAVAILABLE] = ServerUnavailable
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = ServerUnavailable


def from_status(code: grpc.StatusCode, message: str) -> PegaflowError:
    """The typed exception a client raises for a failed RPC."""
    return _BY_CODE.get(code, PegaflowError)(f"{code.name}: {message}")
