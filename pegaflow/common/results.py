"""Results of the engine's operations, shared by the server and the client."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SaveResult:
    stored: int  # copied now
    # Already resident, landed meanwhile by another writer (a save waits for
    # blocks in flight: pegaflow.server.save_waits), or repeated in the request.
    deduplicated: int
    # Not admitted (TinyLFU), no slot free, or not stored by the deadline
    # (another writer's copy of the block failed or had not landed).
    rejected: int


@dataclass(frozen=True, slots=True)
class QueryResult:
    num_blocks: int  # longest resident prefix (or blocks being pulled if loading)
    lease_id: int  # 0 when nothing is leased
    lease_ttl_s: float = 0.0
    loading: bool = False  # a slower tier is pulling blocks in: ask again
    # The server's recent rates, GB/s (0: unknown): its copies from L1 into
    # engines and, when loading, the pulling tier's into L1; loading answers
    # also say how many L1 blocks precede the pulled ones. What the
    # connector's fetch-or-recompute planner weighs (claims: it clamps them).
    ready_blocks: int = 0
    l1_gbps: float = 0.0
    tier_gbps: float = 0.0
    # Set by the engine when the answer needs the metaserver: the server's
    # boundary awaits it for the final result (never sent to a client).
    pending: Callable[[], Awaitable[QueryResult]] | None = None


@dataclass(frozen=True, slots=True)
class LoadResult:
    loaded: int
    bytes: int
    # The copy is queued on the server's GPU stream, not done: it is once the
    # load's done_event completed (pegaflow.client.cuda_export.IpcEvents.wait).
    in_flight: bool = False


@dataclass(frozen=True, slots=True)
class LoadItemResult:
    """One lease of a batched Load."""

    loaded: int
    bytes: int
    error: str = ""  # set when the item's lease was gone; its blocks are untouched


@dataclass(frozen=True, slots=True)
class LoadBatchResult:
    loaded: int  # all items together
    bytes: int
    items: tuple[LoadItemResult, ...]
    in_flight: bool = False  # as LoadResult.in_flight

    @property
    def failed(self) -> list[int]:
        """Indexes of the items that did not load."""
        return [i for i, item in enumerate(self.items) if item.error]


@dataclass(frozen=True, slots=True)
class Registration:
    server_pid: int
    slot_bytes: int
    socket_path: str = ""


@dataclass(frozen=True, slots=True)
class LoadItem:
    """Leased blocks [lease_offset, lease_offset + len(block_ids)) into these
    engine blocks; one per request in a batched load."""

    lease_id: int
    block_ids: Sequence[int] | np.ndarray
    lease_offset: int = 0
