"""The one seam between L1 and the tiers below it.

Every lower tier — the SSD (ssd_link.SsdLink), SSD reads straight into a CUDA
engine's blocks (ssd_gpu_direct.SsdDirect) and peers on other nodes
(remote.link.RemoteLink) — is a `Tier`, and the query path walks the server's
tiers in order (server.query_path): the first that answers anything but a
miss decides. A tier hears what happens in L1 as a StoreListener
(cache.store_events): a block sealed or evicted is its cue to store it, a
block made ready or removed its cue to advertise or withdraw it.

Lookups run on the event loop and never block. A tier that must ask
elsewhere first (the metaserver) answers `asking`, with the coroutine that
finishes the lookup; a tier whose blocks take a while answers `loading` and
brings them into reserved L1 slots meanwhile; the engine polls again.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pegaflow.cache.leases import DirectRead
from pegaflow.cache.store_events import StoreListener
from pegaflow.common.keys import BlockHash, Namespace
from pegaflow.common.rate_meter import RateMeter

if TYPE_CHECKING:
    from pegaflow.cache.instances import Instance

# Where a tier's bytes are: the label of its hits (hit rates, /stats).
Medium = Literal["ssd", "remote"]
State = Literal["miss", "hit", "loading", "asking"]
# Finishes an `asking` lookup, from L1's hits as they stand after the await:
# (namespace, hashes, start) -> a `loading` or a `miss`.
Ask = Callable[[Namespace, list[BlockHash], int], Awaitable["Lookup"]]


@dataclass(frozen=True, slots=True)
class Lookup:
    """A tier's answer for the blocks from the first L1 miss on.

    miss: it holds none of them (or cannot bring them now).
    hit: `blocks` can be read at the engine's Load by `read` (nothing is
      pinned for them; a block gone by then fails its item).
    loading: `blocks` are on their way into reserved L1 slots; `started` when
      this lookup began their load (a hit counted once, not at every poll).
    asking: the answer needs an await first: `ask` gives it.
    """

    state: State
    blocks: int = 0
    started: bool = False
    read: DirectRead | None = None
    ask: Ask | None = None


MISS = Lookup("miss")


class Tier(StoreListener, ABC):
    """A lower tier; what it does with L1's events it overrides from
    StoreListener (store on seal or eviction, advertise, withdraw)."""

    medium: Medium
    # Its lookup may reserve L1 slots (evicting): the query pins its hits meanwhile.
    evicts_on_lookup: bool = False

    @functools.cached_property
    def rate(self) -> RateMeter:
        """Its recent rate into L1 (or an engine), fed by the tier as each
        load ends; query answers carry it to the connector's planner."""
        return RateMeter()

    @abstractmethod
    def lookup(self, inst: Instance, hashes: list[BlockHash], start: int) -> Lookup:
        """What the tier can do for hashes[start:] of this instance's query."""

    def forget(self, ns_id: int) -> None:
        """The namespace was freed: drop what is cached about it (its blocks
        stay where they are, found again when the name comes back)."""

    def sweep(self) -> None:
        """Periodic housekeeping on the event loop (expired pins and the like)."""

    def report(self) -> dict[str, object]:
        """The tier's part of /stats, beside its hit count."""
        return {}

    @abstractmethod
    async def close(self) -> None:
        """Finish or abandon work in flight; runs before the pool goes."""
