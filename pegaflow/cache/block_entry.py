"""A block's entry in the index (pegaflow.cache.block_store), the bit masks of
its pieces and a save's reservation of entries. Values only.

A block has one slot per TP shard and one piece per (shard, layer); each piece
is one bit of a Python int, so per-block bookkeeping is a few int operations
instead of numpy calls (~1 us each). A block is complete when every bit landed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pegaflow.common.keys import Key


def layer_mask(rank: int, layers: np.ndarray, num_layers: int) -> int:
    """Bit rank * num_layers + layer for each layer: a block's (shard, layer)
    pieces as one Python int. `layers` distinct and in range (Engine._layers)."""
    if len(layers) == num_layers:  # every layer, the usual save: no arrays
        return ((1 << num_layers) - 1) << (rank * num_layers)
    bits = np.zeros(num_layers, bool)
    bits[layers] = True
    packed = np.packbits(bits, bitorder="little").tobytes()
    return int.from_bytes(packed, "little") << (rank * num_layers)


@dataclass(slots=True, eq=False)  # identity: compared against None in bulk
class BlockEntry:
    key: Key
    slots: list[int]  # slot address per TP shard, 0 until allocated
    landed: int = 0  # bit rank * num_layers + layer (see layer_mask)
    in_flight: int = 0
    ready: bool = False
    pins: int = 0
    created: float = field(default_factory=time.monotonic)
    row: int = -1  # in its namespace's ReadyIndex, while ready

    def slot_array(self) -> np.ndarray:
        return np.array([s for s in self.slots if s], np.uint64)


@dataclass(frozen=True, slots=True)
class SaveReservation:
    """Blocks of one Save that need copying, with their (now pinned) slots."""

    keys: list[Key]
    entries: list[BlockEntry]
    positions: np.ndarray  # index into the request's block list
    slots: np.ndarray  # uint64 slot address of this rank, per key
    deduplicated: int
    rejected: int
    rank: int = 0
    mask: int = 0  # the (shard, layer) bits this save writes
    shard_mask: int = 0  # every layer bit of this rank's shard
    complete: int = 0  # every bit of a block: it is ready when all landed
    # Deduplicated against a block another save, a lower tier's load or a
    # restart's check was still writing (their positions in the request):
    # the save waits for those to land and copies any that did not.
    waits: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    waited: list[BlockEntry] = field(default_factory=list)
