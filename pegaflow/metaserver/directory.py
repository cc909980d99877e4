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

import numpy as np

from pegaflow.common.keys import NamespaceDigest

from .index import BlockIndex, Hashes
from .meta_config import MetaConfig
from .nodes import Node, NodeTable, UnknownIncarnation

logger = logging.getLogger(__name__)

# A sweep drops stale nodes in chunks of about this many entries (or nodes),
# the lock let go between chunks: ~30 ms of work each on a loaded dev VM.
SWEEP_CHUNK_ENTRIES = 1 << 15
SWEEP_CHUNK_NODES = 128
# Expiry walks the index in slices of this many rows (4 cells each).
EXPIRE_SLICE_ROWS = 1 << 18


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
        self.nodes = NodeTable(config.max_nodes)
        self.index = BlockIndex(config.max_entries, config.max_nodes)
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
        and entries older than --ttl-minutes. Stale nodes go in chunks of
        about SWEEP_CHUNK_ENTRIES entries (each O(its entries): node_cells),
        the lock let go between them: a query waits for one chunk at most,
        not for thousands of nodes dropped one after another."""
        with self._lock:
            stale = self.nodes.stale(self.clock() - self.config.node_stale_s)
            chunks = _chunks(stale, self.index.node_entries)
        for chunk in chunks:
            with self._lock:
                now = self.clock()
                cutoff = now - self.config.node_stale_s
                # Heard from (or gone, or replaced) since the list was made?
                gone = [
                    n
                    for n in chunk
                    if self.nodes.find(n.node_id) is n and n.last_seen < cutoff
                ]
                dropped = self.index.drop_nodes([n.slot for n in gone], "stale_node")
                for node in gone:
                    self.nodes.remove(node)
                self.node_events["stale"] += len(gone)
            if gone:
                logger.warning(
                    "%d node(s) not heard from for %.1f s or more (%s%s): dropped "
                    "with %d entries",
                    len(gone),
                    self.config.node_stale_s,
                    ", ".join(repr(n.node_id) for n in gone[:4]),
                    ", ..." if len(gone) > 4 else "",
                    dropped,
                )
        expired = start = 0
        while True:  # in slices of rows, the lock let go between them
            with self._lock:
                if start >= self.index.rows_used:
                    break
                cutoff = self.clock() - self.config.ttl_s
                stop = start + EXPIRE_SLICE_ROWS
                expired += self.index.expire(cutoff, start, stop)
            start = stop
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


def _chunks(nodes: list[Node], entries: np.ndarray) -> list[list[Node]]:
    """Nodes in runs of about SWEEP_CHUNK_ENTRIES entries (a node with more
    is a run of its own)."""
    out: list[list[Node]] = []
    run: list[Node] = []
    held = 0
    for node in nodes:
        held += int(entries[node.slot])
        run.append(node)
        if held >= SWEEP_CHUNK_ENTRIES or len(run) >= SWEEP_CHUNK_NODES:
            out.append(run)
            run, held = [], 0
    if run:
        out.append(run)
    return out
