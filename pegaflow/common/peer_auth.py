"""The shared peer token between PegaFlow processes of one cluster.

Read once at start (`read_token`), sent by a client as gRPC metadata
(`metadata`), checked by a server on every RPC (`refusal`, constant time). Any
service that talks to peers uses these: the metaserver today, the servers'
Peer service (pegaflow.tiers.remote). Nothing here logs or returns the token itself.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Iterable, Mapping

import grpc

from .errors import PegaflowError

METADATA_KEY = "x-pegaflow-peer-token"  # gRPC metadata keys are lowercase
ENV_VAR = "PEGAFLOW_PEER_TOKEN"  # the default source: it stays out of `ps`
MIN_CHARS = 16
MAX_CHARS = 4096

Metadata = Iterable[tuple[str, str | bytes]]


def check_token(token: str) -> None:
    """A token goes into gRPC metadata: printable ASCII, no spaces, and long
    enough not to be guessed. ValueError says which rule, never the token."""
    if not MIN_CHARS <= len(token) <= MAX_CHARS:
        raise ValueError(
            f"token: {len(token)} characters, need {MIN_CHARS}..{MAX_CHARS}"
        )
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError("token: only printable ASCII without spaces")


def read_token(
    flag: str | None = None,
    env_name: str | None = None,
    path: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """The token from, in this order: the --peer-token value, the variable
    --peer-token-env names, the file --peer-token-file names, $PEGAFLOW_PEER_TOKEN;
    None when no source is given. A source that is given but empty, unset or
    unreadable is an error, never "no token". ValueError names the source as
    `peer_token...: reason` (the CLIs turn it into the flag or variable)."""
    if flag is not None:
        if not flag.strip():
            raise ValueError("peer_token: empty")
        return flag.strip()
    if env_name is not None:
        value = environ.get(env_name, "").strip()
        if not value:
            raise ValueError(f"peer_token_env: ${env_name} is unset or empty")
        return value
    if path is not None:
        return _read_file(path)
    if ENV_VAR in environ:
        value = environ[ENV_VAR].strip()
        if not value:
            raise ValueError("peer_token_var: set but empty")
        return value
    return None


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="ascii") as file:
            mode = os.fstat(file.fileno()).st_mode
            value = file.read(MAX_CHARS + 2).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"peer_token_file: cannot read {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"peer_token_file: {path} is readable by others; chmod 600 it")
    if not value:
        raise ValueError(f"peer_token_file: {path} is empty")
    return value


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """What a client sends with every call: the token, or nothing."""
    return ((METADATA_KEY, token),) if token else ()


def refusal(expected: bytes | None, given: Metadata | None) -> str | None:
    """None when the call may go on (no token required, or the right one sent
    once); otherwise why not, for an UNAUTHENTICATED status: missing or wrong,
    never echoing what was sent."""
    if expected is None:
        return None
    sent = [
        value.encode() if isinstance(value, str) else bytes(value)
        for key, value in given or ()
        if key == METADATA_KEY
    ]
    if not sent:
        return f"{METADATA_KEY}: missing; this service requires the shared peer token"
    if len(sent) > 1:
        return f"{METADATA_KEY}: sent {len(sent)} times, expected once"
    if not hmac.compare_digest(sent[0], expected):  # constant time
        return f"{METADATA_KEY}: wrong token"
    return None


class Unauthenticated(PegaflowError):
    code = grpc.StatusCode.UNAUTHENTICATED


def require(context: grpc.aio.ServicerContext, token: str | None) -> None:
    """For a servicer method: raises Unauthenticated (the interceptor's status)
    unless the call carries `token`, or none is required."""
    if token is None:
        return
    why = refusal(token.encode(), context.invocation_metadata())
    if why is not None:
        raise Unauthenticated(why)
