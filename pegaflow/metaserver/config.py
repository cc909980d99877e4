"""The metaserver's bounds and its one frozen config, built once by the CLI."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from pegaflow.config import LogLevel, check_int, check_seconds, parse_addr

# Every request is bounded by these before any work: the largest legitimate
# request, a 65536-hash batch of 64-byte hashes, is 4 MiB on the wire.
MAX_BATCH_HASHES = 65536
MAX_NAMESPACE_BYTES = 64
MAX_NODE_ID_BYTES = 128
MAX_ENDPOINT_BYTES = 256
MAX_MESSAGE_BYTES = 8 << 20
MAX_CONCURRENT_RPCS = 1024
MAX_NODES = 4096
MAX_NAMESPACES = 4096
# Owners remembered per block: a fifth node advertising it replaces the owner
# heard from longest ago (a plan needs one live owner, not all of them).
OWNERS_PER_BLOCK = 4
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
TOKEN_METADATA_KEY = "x-pegaflow-token"


@dataclass(frozen=True, slots=True)
class MetaConfig:
    addr: str = "127.0.0.1:50056"
    http_addr: str | None = "127.0.0.1:9092"
    node_stale_s: float = 30.0
    ttl_s: float = 3600.0
    max_entries: int = 4_000_000
    log_level: LogLevel = "info"
    token: str | None = None  # the shared peer token; None: no token asked
    max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS

    def __post_init__(self) -> None:
        parse_addr(self.addr)
        if self.http_addr is not None:
            parse_addr(self.http_addr)
        check_seconds("node_stale_s", self.node_stale_s, 86400.0)
        check_seconds("ttl_s", self.ttl_s, 30 * 86400.0)
        check_int("max_entries", self.max_entries, 16, (1 << 31) - 1)
        check_int("max_concurrent_rpcs", self.max_concurrent_rpcs, 1, 1 << 16)
        if self.token is not None:
            check_token(self.token)

    @property
    def heartbeat_interval_s(self) -> float:
        """What nodes are told to keep: three beats fit in one stale period."""
        return self.node_stale_s / 3

    @property
    def sweep_interval_s(self) -> float:
        """How often stale nodes and expired entries are looked for: an entry
        outlives its TTL by at most an eighth of it."""
        return min(max(min(self.node_stale_s / 4, self.ttl_s / 8), 0.05), 5.0)


def check_token(token: str) -> None:
    """A token goes into gRPC metadata: printable ASCII, no spaces, and long
    enough not to be guessed."""
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ValueError(
            f"token: {len(token)} characters, need {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS}"
        )
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError("token: only printable ASCII without spaces")


def read_token(env_name: str | None, path: str | None) -> str | None:
    """The shared token from an environment variable or a file (so it stays out
    of `ps`); None when neither is named. ValueError names the flag."""
    if env_name is not None:
        value = os.environ.get(env_name, "")
        if not value:
            raise ValueError(f"peer_token_env: ${env_name} is unset or empty")
        return value.strip()
    if path is None:
        return None
    try:
        with open(path, encoding="ascii") as file:
            mode = os.fstat(file.fileno()).st_mode
            value = file.read(MAX_TOKEN_CHARS + 2).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"peer_token_file: cannot read {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"peer_token_file: {path} is readable by others; chmod 600 it")
    if not value:
        raise ValueError(f"peer_token_file: {path} is empty")
    return value
