"""The cluster's shared token on node-to-node RPCs (the Peer service of every
pegaflow-server): sent as gRPC metadata, compared in constant time, a missing
or wrong one answered UNAUTHENTICATED without echoing it."""

from __future__ import annotations

import hmac

import grpc

from pegaflow.errors import PegaflowError
from pegaflow.metaserver.config import TOKEN_METADATA_KEY


class Unauthenticated(PegaflowError):
    code = grpc.StatusCode.UNAUTHENTICATED


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA_KEY, token),) if token else ()


def check(given: str | bytes | None, token: str | None) -> None:
    if token is None:
        return
    if given is None:
        raise Unauthenticated(
            f"{TOKEN_METADATA_KEY}: missing; this node needs the peer token"
        )
    raw = given.encode() if isinstance(given, str) else bytes(given)
    if not hmac.compare_digest(raw, token.encode()):
        raise Unauthenticated(f"{TOKEN_METADATA_KEY}: wrong peer token")


def require(context: grpc.aio.ServicerContext, token: str | None) -> None:
    if token is None:
        return
    given = None
    for key, value in context.invocation_metadata() or ():
        if key == TOKEN_METADATA_KEY:
            given = value
    check(given, token)
