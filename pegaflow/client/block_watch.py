"""The server's block events of one instance's namespace (WatchBlocks), as
plain values: what the connector turns into vLLM's KV events
(pegaflow.connector.kv_events). Protocol: pegaflow.server.block_events."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import grpc

from pegaflow.common.errors import PegaflowError, from_status
from pegaflow.common.keys import BlockHash
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

EventKind = Literal["stored", "removed"]
BlockTier = Literal["l1", "ssd", "peer"]
_KINDS: dict[int, EventKind] = {
    pb.BlockEvent.STORED: "stored",
    pb.BlockEvent.REMOVED: "removed",
}
_TIERS: dict[int, BlockTier] = {
    pb.BLOCK_TIER_L1: "l1",
    pb.BLOCK_TIER_SSD: "ssd",
    pb.BLOCK_TIER_PEER: "peer",
}


@dataclass(frozen=True, slots=True)
class BlockEvent:
    kind: EventKind
    tier: BlockTier
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockEvents:
    """One batch, in order. resync: forget what the stream said before; the
    blocks held now follow as stored events up to snapshot_done."""

    events: tuple[BlockEvent, ...]
    resync: bool = False
    snapshot_done: bool = False


class BlockWatch:
    """An open WatchBlocks stream: iterate for batches (blocking; a server
    error or the end of the stream raises PegaflowError); cancel() from any
    thread ends the iteration."""

    def __init__(self, stub: pb_grpc.PegaFlowStub, instance_id: str) -> None:
        # No deadline: the stream lasts as long as the engine.
        self._call = stub.WatchBlocks(pb.WatchBlocksRequest(instance_id=instance_id))

    def __iter__(self) -> Iterator[BlockEvents]:
        try:
            for msg in self._call:
                yield _batch(msg)
        except grpc.RpcError as exc:
            raise from_status(exc.code(), exc.details() or "") from None
        raise PegaflowError("WatchBlocks: the server ended the stream")

    def cancel(self) -> None:
        self._call.cancel()


def _batch(msg: pb.BlockEvents) -> BlockEvents:
    """Unknown kinds and tiers (a newer server) are skipped."""
    events = tuple(
        BlockEvent(_KINDS[e.kind], _TIERS[e.tier], tuple(e.block_hashes))
        for e in msg.events
        if e.kind in _KINDS and e.tier in _TIERS
    )
    return BlockEvents(events, msg.resync, msg.snapshot_done)
