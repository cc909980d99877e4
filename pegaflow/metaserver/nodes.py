"""Nodes known to the metaserver: id, incarnation, endpoint, when last heard.

Each node gets a small slot number that the block index stores per owner. An
incarnation is a node process's start: a larger one replaces a smaller one
(fencing its entries), a smaller one than the registered is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from pegaflow.common.errors import PegaflowError

from .meta_config import MAX_NODES

logger = logging.getLogger(__name__)

NodeSlot = int


class UnknownIncarnation(PegaflowError):
    """The metaserver holds nothing of this incarnation (it restarted, dropped
    the node as stale, or never saw it join): Join, then re-send every block."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Superseded(PegaflowError):
    """A newer incarnation of this node id has joined: this process is an old
    one and must stop advertising."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class TooManyNodes(PegaflowError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(slots=True)
class Node:
    node_id: str
    incarnation: int
    endpoint: str
    slot: NodeSlot
    last_seen: float


class NodeTable:
    def __init__(self, max_nodes: int = MAX_NODES) -> None:
        self.max_nodes = max_nodes
        self.by_id: dict[str, Node] = {}
        self.by_slot: dict[NodeSlot, Node] = {}
        self._free: list[NodeSlot] = list(range(max_nodes - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.by_id)

    def join(
        self, node_id: str, incarnation: int, endpoint: str, now: float
    ) -> tuple[Node, bool]:
        """The node as registered now, and whether an older incarnation was
        replaced (its entries must go: the caller drops the slot's entries)."""
        node = self.by_id.get(node_id)
        if node is not None and incarnation < node.incarnation:
            raise Superseded(
                f"node.incarnation: superseded incarnation (node {node_id!r} "
                f"joined as {node.incarnation})"
            )
        if node is not None:
            fenced = incarnation > node.incarnation
            node.incarnation, node.endpoint, node.last_seen = (
                incarnation,
                endpoint,
                now,
            )
            return node, fenced
        if not self._free:
            raise TooManyNodes(
                f"node: {self.max_nodes} nodes joined, the most held (--max-nodes)"
            )
        node = Node(node_id, incarnation, endpoint, self._free.pop(), now)
        self.by_id[node_id] = self.by_slot[node.slot] = node
        return node, False

    def check(self, node_id: str, incarnation: int, now: float) -> tuple[Node, bool]:
        """The registered node of this exact incarnation (its last_seen is now).
        A newer incarnation than the registered one removes the old node (the
        bool says so: the caller drops its entries and then raises
        UnknownIncarnation, so the new process joins)."""
        node = self.by_id.get(node_id)
        if node is None:
            raise UnknownIncarnation(
                f"node: unknown incarnation (node {node_id!r} has not joined)"
            )
        if incarnation < node.incarnation:
            raise Superseded(
                f"node.incarnation: superseded incarnation (node {node_id!r} "
                f"joined as {node.incarnation})"
            )
        if incarnation > node.incarnation:
            return node, True
        node.last_seen = now
        return node, False

    def remove(self, node: Node) -> None:
        del self.by_id[node.node_id]
        del self.by_slot[node.slot]
        self._free.append(node.slot)

    def stale(self, cutoff: float) -> list[Node]:
        """Nodes last heard before cutoff."""
        return [n for n in self.by_id.values() if n.last_seen < cutoff]

    def find(self, node_id: str) -> Node | None:
        return self.by_id.get(node_id)
