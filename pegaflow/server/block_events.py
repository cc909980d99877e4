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

L1 only: the SSD tier drops blocks inside its ring without telling the loop,
and peers' pools are the metaserver's; their tiers (BLOCK_TIER_SSD, _PEER)
are in the protocol for later.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter, itemgetter

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
L1 = pb.BLOCK_TIER_L1
MAX_PER_INSTANCE = 4  # a scheduler's stream per part, and a reconnect's overlap
BATCH_HASHES = 4096  # per message (~140 KB of 32-byte hashes)
COALESCE_S = 0.02  # a message waits this long for more events once one came
IDLE_CHECK_S = 1.0  # an idle stream checks its namespace still stands
SNAPSHOT_SCAN = 16384  # store keys scanned between yields to the loop
WRITE_STALL_S = 30.0  # a client that takes no message for this long is ended

_KEY = attrgetter("key")
Write = Callable[[pb.BlockEvents], Awaitable[None]]


@dataclass(slots=True, eq=False)
class Watcher:
    """One stream's backlog: runs of (kind, hashes) in order, bounded."""

    instance_id: str
    ns: Namespace
    limit: int  # hashes waiting before the backlog is dropped for a resync
    runs: deque[tuple[int, list[BlockHash]]] = field(default_factory=deque)
    count: int = 0
    overflowed: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, kind: int, hashes: list[BlockHash]) -> None:
        if self.overflowed:
            return
        if self.count + len(hashes) > self.limit:
            self.runs.clear()
            self.count = 0
            self.overflowed = True
            self.wake.set()
            return
        if self.runs and self.runs[-1][0] == kind:
            self.runs[-1][1].extend(hashes)
        else:
            self.runs.append((kind, list(hashes)))
        self.count += len(hashes)
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
            kind, hashes = self.runs[0]
            if len(hashes) <= n:
                self.runs.popleft()
                part = hashes
            else:
                part, self.runs[0] = hashes[:n], (kind, hashes[n:])
            n -= len(part)
            self.count -= len(part)
            out.append(pb.BlockEvent(kind=kind, tier=L1, block_hashes=part))
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
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        watchers = self._by_ns.get(watcher.ns.id)
        if watchers is None or watcher not in watchers:
            return
        watchers.discard(watcher)
        if not watchers:
            del self._by_ns[watcher.ns.id]
        self._count -= 1

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
        done = _stored(found) if found else pb.BlockEvents()
        done.snapshot_done = True
        await _send(write, done)


def _stored(hashes: list[BlockHash]) -> pb.BlockEvents:
    return pb.BlockEvents(
        events=[pb.BlockEvent(kind=STORED, tier=L1, block_hashes=hashes)]
    )


async def _send(write: Write, message: pb.BlockEvents) -> None:
    try:
        await asyncio.wait_for(write(message), WRITE_STALL_S)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            f"WatchBlocks: the client took no message for {WRITE_STALL_S:g} s"
        ) from None
