"""The metaserver's bounds and its one frozen config, built once by the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from pegaflow.common.peer_auth import check_token
from pegaflow.common.settings import LogLevel, check_int, check_seconds, parse_addr

# Every request is bounded by these before any work: the largest legitimate
# request, a 65536-hash batch of 64-byte hashes, is 4 MiB on the wire.
MAX_BATCH_HASHES = 65536
MAX_NAMESPACE_BYTES = 64
MAX_NODE_ID_BYTES = 128
MAX_ENDPOINT_BYTES = 256
MAX_MESSAGE_BYTES = 8 << 20
MAX_CONCURRENT_RPCS = 1024
MAX_NODES = 4096  # --max-nodes' default
# --max-nodes' ceiling: a node's slot is an int32 owner cell, and every node
# costs a little in each sweep and per-node array.
MAX_NODES_LIMIT = 1 << 16
MAX_NAMESPACES = 4096
# Owners remembered per block: a fifth node advertising it replaces the owner
# heard from longest ago (a plan needs one live owner, not all of them).
OWNERS_PER_BLOCK = 4


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
    max_nodes: int = MAX_NODES

    def __post_init__(self) -> None:
        parse_addr(self.addr)
        if self.http_addr is not None:
            parse_addr(self.http_addr)
        check_seconds("node_stale_s", self.node_stale_s, 86400.0)
        check_seconds("ttl_s", self.ttl_s, 30 * 86400.0)
        check_int("max_entries", self.max_entries, 16, (1 << 31) - 1)
        check_int("max_concurrent_rpcs", self.max_concurrent_rpcs, 1, 1 << 16)
        check_int("max_nodes", self.max_nodes, 1, MAX_NODES_LIMIT)
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
