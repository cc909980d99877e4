"""The metaserver's operations: nodes (join, heartbeat, leave, staleness) over
the block index. gRPC's handler threads and the sweep thread call it; one
lock makes each operation atomic. The servicer calls it with values already
checked."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pegaflow.common.keys import NamespaceDigest

from .index import BlockIndex, Hashes
from .meta_config import MetaConfig
from .nodes import Node, NodeTable, UnknownIncarnation

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Segment:
    """The next `blocks` hashes of a prefix, read from this node."""

    node_id: str
    incarnation: int
    endpoint: str
    blocks: int


class Directory:
    def __init__(
        self, config: MetaConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.nodes = NodeTable()
        self.index = BlockIndex(config.max_entries)
        self.node_events: Counter[str] = Counter()  # joined, fenced, stale, left
        self.queries = 0
        self.query_hashes = 0
        self.query_matched = 0
        # Every operation below holds it whole; readers of plain counts (the
        # HTTP thread's /health and /metrics) do not.
        self._lock = threading.Lock()

    def join(self, node_id: str, incarnation: int, endpoint: str) -> Node:
        with self._lock:
            node, fenced = self.nodes.join(node_id, incarnation, endpoint, self.clock())
            if fenced:
                self._fence(node, incarnation)
            self.node_events["joined"] += 1
            logger.info(
                "node %r joined: incarnation %d, endpoint %s",
                node_id,
                incarnation,
                endpoint,
            )
            return node

    def heartbeat(self, node_id: str, incarnation: int) -> int:
        """The entries held for the node."""
        with self._lock:
            return int(self.index.node_entries[self._known(node_id, incarnation).slot])

    def insert(
        self,
        node_id: str,
        incarnation: int,
        digest: NamespaceDigest,
        hashes: Hashes,
    ) -> tuple[int, int]:
        with self._lock:
            node = self._known(node_id, incarnation)
            return self.index.insert(digest, hashes, node.slot, self.clock())

    def remove(
        self,
        node_id: str,
        incarnation: int,
        digest: NamespaceDigest,
        hashes: Hashes,
    ) -> int:
        with self._lock:
            node = self._known(node_id, incarnation)
            return self.index.remove(digest, hashes, node.slot)

    def leave(self, node_id: str, incarnation: int) -> int:
        with self._lock:
            node = self._known(node_id, incarnation)
            removed = self.index.drop_node(node.slot, "left")
            self.nodes.remove(node)
            self.node_events["left"] += 1
            logger.info("node %r left: %d entries dropped", node_id, removed)
            return removed

    def query(
        self, digest: NamespaceDigest, hashes: Hashes, asker: str
    ) -> list[Segment]:
        with self._lock:
            node = self.nodes.find(asker) if asker else None
            plan = self.index.prefix(digest, hashes, node.slot if node else -1)
            owners = self.nodes.by_slot
            segments = [
                Segment(o.node_id, o.incarnation, o.endpoint, blocks)
                for o, blocks in ((owners[slot], blocks) for slot, blocks in plan)
            ]
            self.queries += 1
            self.query_hashes += len(hashes)
            self.query_matched += sum(s.blocks for s in segments)
            return segments

    def sweep(self) -> None:
        """Drop nodes not heard from for --node-stale-secs, with their entries,
        and entries older than --ttl-minutes."""
        with self._lock:
            now = self.clock()
            for node in self.nodes.stale(now - self.config.node_stale_s):
                dropped = self.index.drop_node(node.slot, "stale_node")
                self.nodes.remove(node)
                self.node_events["stale"] += 1
                logger.warning(
                    "node %r not heard from for %.1f s: dropped with %d entries",
                    node.node_id,
                    now - node.last_seen,
                    dropped,
                )
            expired = self.index.expire(now - self.config.ttl_s)
            if expired:
                logger.debug("%d entries expired", expired)

    def _known(self, node_id: str, incarnation: int) -> Node:
        node, newer = self.nodes.check(node_id, incarnation, self.clock())
        if newer:  # the node restarted: what the old process advertised is gone
            self._fence(node, incarnation)
            self.nodes.remove(node)
            raise UnknownIncarnation(
                f"node: unknown incarnation {incarnation} (node {node_id!r} "
                "restarted; join again)"
            )
        return node

    def _fence(self, node: Node, incarnation: int) -> None:
        dropped = self.index.drop_node(node.slot, "fenced")
        self.node_events["fenced"] += 1
        logger.info(
            "node %r: incarnation %d fences the older one's %d entries",
            node.node_id,
            incarnation,
            dropped,
        )
