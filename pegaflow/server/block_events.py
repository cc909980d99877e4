"""KV events for routers: what L1 holds, streamed per namespace to the engines
that ask (WatchBlocks), which turn it into vLLM's KV cache events
(pegaflow.connector.kv_events) so KV-aware routers (llm-d, Dynamo) see what
any engine of the namespace can hit: blocks other engines saved, blocks the
server evicted.

A stream starts with a resync: the namespace's ready blocks as STORED events,
then `snapshot_done`; from then on each block made ready (a save, an SSD
load, a warm restart's adoption) or removed (evicted, namespace freed) as it
happens, coalesced into one message per ~COALESCE_S or BATCH_HASHES hashes.
The hub hears L1 as a StoreListener and only appends to each watcher's
buffer on the event loop: a save never waits for a watcher. A watcher whose
buffer passes --block-events-buffer hashes (a client reading too slowly, or
not at all) loses its backlog and is sent a resync with the blocks held
again, so a client that never reads costs one bounded buffer; one that takes
no message for WRITE_STALL_S is ended.

The SSD tier's blocks come as events of tier SSD: while anyone watches, its
index records what it commits and drops (pegaflow.gds), and the hub takes that
record at each sweep (`poll_tiers`, every --lease-sweep-interval); a snapshot
lists the namespace's SSD blocks after its L1 ones. A record that grew past
its bound between two takes is dropped and every watcher resyncs. Peers'
pools are the metaserver's: their tier (BLOCK_TIER_PEER) is in the protocol
for later.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter, itemgetter
from typing import Protocol

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.instances import Registry
from pegaflow.cache.store_events import StoreListener
from pegaflow.common.errors import DeadlineExceeded, Overloaded, UnknownInstance
from pegaflow.common.identity import CallContext
from pegaflow.common.keys import BlockHash, Key, Namespace
from pegaflow.proto import pegaflow_pb2 as pb

from .query_path import PrefixQueries

logger = logging.getLogger(__name__)

STORED, REMOVED = pb.BlockEvent.STORED, pb.BlockEvent.REMOVED
L1, SSD = pb.BLOCK_TIER_L1, pb.BLOCK_TIER_SSD
MAX_PER_INSTANCE = 4  # a scheduler's stream per part, and a reconnect's overlap
BATCH_HASHES = 4096  # per message (~140 KB of 32-byte hashes)
COALESCE_S = 0.02  # a message waits this long for more events once one came
IDLE_CHECK_S = 1.0  # an idle stream checks its namespace still stands
SNAPSHOT_SCAN = 16384  # store keys scanned between yields to the loop
WRITE_STALL_S = 30.0  # a client that takes no message for this long is ended

_KEY = attrgetter("key")
Write = Callable[[pb.BlockEvents], Awaitable[None]]


class TierEvents(Protocol):
    """A lower tier's block events (pegaflow.tiers.ssd_link.SsdLink)."""

    def track(self, on: bool) -> None: ...
    def take_events(self) -> tuple[list[tuple[bool, int, list[BlockHash]]], bool]: ...
    def hashes(self, ns: Namespace) -> list[BlockHash]: ...


@dataclass(slots=True, eq=False)
class Watcher:
    """One stream's backlog: runs of (kind, hashes) in order, bounded."""

    instance_id: str
    ns: Namespace
    limit: int  # hashes waiting before the backlog is dropped for a resync
    runs: deque[tuple[int, int, list[BlockHash]]] = field(default_factory=deque)
    count: int = 0
    overflowed: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, kind: int, hashes: list[BlockHash], tier: int = L1) -> None:
        if self.overflowed:
            return
        if self.count + len(hashes) > self.limit:
            self.drop()
            return
        if self.runs and self.runs[-1][:2] == (kind, tier):
            self.runs[-1][2].extend(hashes)
        else:
            self.runs.append((kind, tier, list(hashes)))
        self.count += len(hashes)
        self.wake.set()

    def drop(self) -> None:
        """The backlog is lost: the stream resyncs."""
        self.runs.clear()
        self.count = 0
        self.overflowed = True
        self.wake.set()

    def restart(self) -> None:
        """Recording starts over (before a snapshot is taken)."""
        self.runs.clear()
        self.count = 0
        self.overflowed = False

    def take(self, n: int) -> list[pb.BlockEvent]:
        """Up to n hashes from the front, in order."""
        out: list[pb.BlockEvent] = []
        while self.runs and n > 0:
            kind, tier, hashes = self.runs[0]
            if len(hashes) <= n:
                self.runs.popleft()
                part = hashes
            else:
                part, self.runs[0] = hashes[:n], (kind, tier, hashes[n:])
            n -= len(part)
            self.count -= len(part)
            out.append(pb.BlockEvent(kind=kind, tier=tier, block_hashes=part))
        return out


class BlockEventHub(StoreListener):
    """The watchers by namespace id; all calls on the event loop."""

    def __init__(
        self,
        registry: Registry,
        store: BlockStore,
        queries: PrefixQueries,
        max_watchers: int = 64,
        buffer_hashes: int = 1 << 16,
        on_resync: Callable[[], None] = lambda: None,
    ) -> None:
        """on_resync: told each time a stream fell behind (its backlog went)."""
        self._registry = registry
        self._store = store
        self._queries = queries
        self.max_watchers = max_watchers
        self.buffer_hashes = buffer_hashes
        self._on_resync = on_resync
        self._by_ns: dict[int, set[Watcher]] = {}
        self._count = 0
        self.ssd: TierEvents | None = None  # set at start-up with an SSD tier

    @property
    def watchers(self) -> int:
        return self._count

    # -- StoreListener: append only ------------------------------------------
    def ready(self, entries: list[BlockEntry]) -> None:
        if self._by_ns and entries:
            self._tell(STORED, list(map(_KEY, entries)))

    def removed(self, keys: list[Key]) -> None:
        if self._by_ns and keys:
            self._tell(REMOVED, keys)

    def _tell(self, kind: int, keys: list[Key]) -> None:
        ns_ids = set(map(itemgetter(0), keys))
        for ns_id in ns_ids:
            watchers = self._by_ns.get(ns_id)
            if not watchers:
                continue
            mine = keys if len(ns_ids) == 1 else [k for k in keys if k[0] == ns_id]
            hashes = list(map(itemgetter(1), mine))
            for watcher in watchers:
                watcher.add(kind, hashes)

    def poll_tiers(self) -> None:
        """The SSD tier's changes since the last poll, to their watchers (the
        sweep calls this)."""
        if self.ssd is None or not self._count:
            return
        runs, lost = self.ssd.take_events()
        if lost:  # too many changes between two polls: everyone resyncs
            for watchers in self._by_ns.values():
                for watcher in watchers:
                    watcher.drop()
            return
        for stored, ns_id, hashes in runs:
            kind = STORED if stored else REMOVED
            for watcher in self._by_ns.get(ns_id, ()):
                watcher.add(kind, hashes, SSD)

    # -- streams ---------------------------------------------------------------
    def watch(self, instance_id: str, ctx: CallContext) -> Watcher:
        """A new watcher of the instance's namespace, if the caller may ask
        (as for QueryPrefix: the instance's user, or root) and the limits let
        it; it records from now on."""
        inst = self._queries.admit(instance_id, 0, ctx)
        if self._count >= self.max_watchers:
            raise Overloaded(
                f"WatchBlocks: {self._count} block event streams are open, the "
                f"server's limit (--max-block-watchers {self.max_watchers})"
            )
        mine = sum(
            w.instance_id == instance_id for w in self._by_ns.get(inst.namespace.id, ())
        )
        if mine >= MAX_PER_INSTANCE:
            raise Overloaded(
                f"instance_id: {instance_id!r} already has {mine} block event "
                f"streams open (at most {MAX_PER_INSTANCE})"
            )
        watcher = Watcher(instance_id, inst.namespace, self.buffer_hashes)
        self._by_ns.setdefault(inst.namespace.id, set()).add(watcher)
        self._count += 1
        if self._count == 1 and self.ssd is not None:
            self.ssd.track(True)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        watchers = self._by_ns.get(watcher.ns.id)
        if watchers is None or watcher not in watchers:
            return
        watchers.discard(watcher)
        if not watchers:
            del self._by_ns[watcher.ns.id]
        self._count -= 1
        if self._count == 0 and self.ssd is not None:
            self.ssd.track(False)

    async def serve(self, watcher: Watcher, write: Write) -> None:
        """Send the watcher's stream until the client goes (the caller's
        write raises), its namespace is freed (UnknownInstance: watch again)
        or it takes nothing for WRITE_STALL_S (DeadlineExceeded)."""
        try:
            while True:
                await self._snapshot(watcher, write)
                while not watcher.overflowed:
                    events = await self._next(watcher)
                    if self._registry.namespaces.get(watcher.ns.name) is not watcher.ns:
                        raise UnknownInstance(
                            f"instance_id: the namespace of {watcher.instance_id!r} "
                            "was freed (no engine left in it); watch again"
                        )
                    if events:
                        await _send(write, pb.BlockEvents(events=events))
                logger.debug("block events of %s: resync", watcher.instance_id)
                self._on_resync()
        finally:
            self.unwatch(watcher)

    async def _next(self, watcher: Watcher) -> list[pb.BlockEvent]:
        """The next batch: waits for a first event (IDLE_CHECK_S at most),
        then COALESCE_S for more unless a batch is full already."""
        if not watcher.count and not watcher.overflowed:
            watcher.wake.clear()
            try:
                await asyncio.wait_for(watcher.wake.wait(), IDLE_CHECK_S)
            except asyncio.TimeoutError:
                return []
        if watcher.count < BATCH_HASHES and not watcher.overflowed:
            await asyncio.sleep(COALESCE_S)
        return [] if watcher.overflowed else watcher.take(BATCH_HASHES)

    async def _snapshot(self, watcher: Watcher, write: Write) -> None:
        """A resync, then the namespace's ready blocks. Events recorded from
        before the scan on follow it: a block that changed meanwhile ends as
        its last event says, whatever the scan saw."""
        watcher.restart()
        await _send(write, pb.BlockEvents(resync=True))
        ns_id, entries = watcher.ns.id, self._store.entries
        keys = iter(list(entries))  # one C-level copy; entries change meanwhile
        found: list[BlockHash] = []
        while chunk := list(islice(keys, SNAPSHOT_SCAN)):
            for key in chunk:
                if key[0] == ns_id and (e := entries.get(key)) is not None and e.ready:
                    found.append(key[1])
            while len(found) >= BATCH_HASHES:
                part, found = found[:BATCH_HASHES], found[BATCH_HASHES:]
                await _send(write, _stored(part))
            await asyncio.sleep(0)  # the loop serves saves and queries meanwhile
        if found:
            await _send(write, _stored(found))
        on_ssd = self.ssd.hashes(watcher.ns) if self.ssd is not None else []
        for i in range(0, len(on_ssd), BATCH_HASHES):
            await _send(write, _stored(on_ssd[i : i + BATCH_HASHES], SSD))
        await _send(write, pb.BlockEvents(snapshot_done=True))


def _stored(hashes: list[BlockHash], tier: int = L1) -> pb.BlockEvents:
    return pb.BlockEvents(
        events=[pb.BlockEvent(kind=STORED, tier=tier, block_hashes=hashes)]
    )


async def _send(write: Write, message: pb.BlockEvents) -> None:
    try:
        await asyncio.wait_for(write(message), WRITE_STALL_S)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            f"WatchBlocks: the client took no message for {WRITE_STALL_S:g} s"
        ) from None
