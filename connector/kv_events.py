"""KV events for routers, engine side: what the server's pool holds for this
engine's namespace, as vLLM's KV cache events (`BlockStored`, `BlockRemoved`),
returned from the scheduler connector's `take_events()` so vLLM publishes
them with its own (`--kv-events-config`). A KV-aware router (llm-d, Dynamo)
then sees what this engine can hit beyond its GPU: blocks any engine of the
namespace saved, minus those the server evicted.

One daemon thread per watched part consumes the server's WatchBlocks stream
(pegaflow.server.block_events), reconnecting with backoff when the server
restarts. The stream's snapshot after every (re)connect or resync is diffed
against what vLLM was told, so the published events stay exact: a block is
announced once while held and removed once when gone, whatever was missed.
Between two engine steps only each block's latest state is kept (`_dirty`):
vLLM publishes connector events only from a step, so an idle engine's
events wait for its next step, bounded by MAX_TRACKED blocks.

Mediums follow vLLM's own offloading connector: the server's DRAM pool is
`CPU` (locality `LOCAL`), its SSD `STORAGE`, a peer's pool `CPU` / `REMOTE`
(the server streams L1 and SSD events; peers' pools are not streamed). Token
ids are known for the blocks this engine saved itself (with their parent
hash); other engines' blocks carry none, like vLLM's offloading
placeholders (`token_ids=[]`, `block_size=0`, no parent). Watched:
full-attention groups whose block is one hash block, of pipeline stage 0.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pegaflow.client.block_watch import BlockEvents, BlockTier
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import PegaflowError
from pegaflow.common.keys import BlockHash

from .kv_groups import KVGroups
from .step_plan import SaveJob

logger = logging.getLogger(__name__)

# (medium, locality) per server tier; vLLM's MEDIUM_CPU / MEDIUM_STORAGE.
MEDIUMS: dict[BlockTier, tuple[str, str]] = {
    "l1": ("CPU", "LOCAL"),
    "ssd": ("STORAGE", "LOCAL"),
    "peer": ("CPU", "REMOTE"),
}
MAX_TRACKED = 1 << 21  # blocks per part and tier told to vLLM (~200 MB at most)
OWN_BLOCKS = 1 << 16  # this engine's saved blocks awaiting their stored event
BACKOFF_S = (0.2, 5.0)  # first and longest wait before reconnecting


@dataclass(frozen=True, slots=True)
class WatchedPart:
    instance: str  # the server instance of the part (KVGroups.part_instance)
    group: int  # vLLM's kv_cache_group_id
    block_size: int


@dataclass(frozen=True, slots=True)
class _Own:
    parent: BlockHash | None
    tokens: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None


@dataclass(slots=True)
class _Run:
    """Consecutive stored blocks of one event: own (its first block's
    parent and LoRA) with their tokens, or None: blocks of unknown tokens."""

    hashes: list[BlockHash]
    own: _Own | None
    tokens: list[int] = field(default_factory=list)


class _TierState:
    """One part's view of one tier: what vLLM was told, and what changed
    since (hash -> held now)."""

    __slots__ = ("published", "dirty", "incoming")

    def __init__(self) -> None:
        self.published: set[BlockHash] = set()
        self.dirty: dict[BlockHash, bool] = {}
        self.incoming: set[BlockHash] | None = None  # a snapshot in progress

    def change(self, hashes: Iterable[BlockHash], held: bool) -> None:
        if self.incoming is not None and held:
            self.incoming.update(hashes)
            return
        self.dirty.update(dict.fromkeys(hashes, held))
        if len(self.dirty) > 2 * MAX_TRACKED:  # an idle engine under churn
            self.dirty = {
                h: v for h, v in self.dirty.items() if v or h in self.published
            }

    def snapshot_done(self) -> None:
        """The blocks held are `incoming`: diff it against what was told."""
        now, self.incoming = self.incoming or set(), None
        self.dirty = dict.fromkeys(self.published - now, False)
        self.dirty.update(dict.fromkeys(now - self.published, True))


class KVEventsFeed:
    """The server's block events of the watched parts, as vLLM KV events."""

    def __init__(self, addr: str, parts: list[WatchedPart]) -> None:
        self.parts = parts
        self._client = PegaflowClient(addr)
        self._lock = threading.Lock()
        self._states = [{tier: _TierState() for tier in MEDIUMS} for _ in parts]
        self._groups = {p.group: p for p in parts}
        self._own: OrderedDict[BlockHash, _Own] = OrderedDict()
        self._requests: dict[str, Any] = {}  # vLLM requests, for their tokens
        self._finishing: set[str] = set()
        self._stop = threading.Event()
        self._watches: dict[int, Any] = {}
        self._threads = [
            threading.Thread(
                target=self._run, args=(i,), daemon=True, name=f"pegaflow-events-{i}"
            )
            for i in range(len(parts))
        ]
        for thread in self._threads:
            thread.start()

    # -- the stream (one thread per part) -------------------------------------
    def _run(self, i: int) -> None:
        part, wait, warned = self.parts[i], BACKOFF_S[0], False
        while not self._stop.is_set():
            try:
                watch = self._watches[i] = self._client.watch_blocks(part.instance)
                if self._stop.is_set():  # closed meanwhile: cancel() missed it
                    watch.cancel()
                    return
                for batch in watch:
                    self._apply(i, batch)
                    if wait != BACKOFF_S[0] or warned:
                        logger.info("pegaflow: KV events of %s resumed", part.instance)
                        wait, warned = BACKOFF_S[0], False
            except PegaflowError as exc:
                if self._stop.is_set():
                    return
                log = logger.debug if warned else logger.warning
                log("pegaflow: KV events of %s: %s; retrying", part.instance, exc)
                warned = True
            except Exception:  # a background loop must survive anything
                logger.exception("pegaflow: KV events of %s failed", part.instance)
            self._stop.wait(wait)
            wait = min(wait * 2, BACKOFF_S[1])

    def _apply(self, i: int, batch: BlockEvents) -> None:
        with self._lock:
            states = self._states[i]
            if batch.resync:
                for state in states.values():
                    state.incoming = set()
            for event in batch.events:
                states[event.tier].change(event.hashes, event.kind == "stored")
            if batch.snapshot_done:
                for state in states.values():
                    state.snapshot_done()

    # -- this engine's own saves: their token ids -------------------------------
    def track(self, request: Any) -> None:
        """A request the scheduler allocated blocks for (its saves follow)."""
        self._requests[request.request_id] = request

    def finishing(self, req_id: str) -> None:
        """Its last saves are in the next plan; forget it after that one."""
        self._finishing.add(req_id)

    def note_saves(self, saves: list[SaveJob]) -> None:
        """The blocks a step's plan saves, with their tokens and parents, for
        the stored events the server sends back."""
        own: list[tuple[BlockHash, _Own]] = []
        for job in saves:
            part = self._groups.get(job.group)
            req = self._requests.get(job.req_id)
            if part is None or req is None or not job.hashes:
                continue
            hashes = req.block_hashes
            try:
                first = hashes.index(job.hashes[0])
            except ValueError:
                continue
            lora = getattr(req, "lora_request", None)
            tokens, bs = req.all_token_ids, part.block_size
            for p, h in enumerate(job.hashes, first):
                if p >= len(hashes) or hashes[p] != h:
                    break
                parent = hashes[p - 1] if p else None
                own.append(
                    (
                        h,
                        _Own(
                            parent,
                            tuple(tokens[p * bs : (p + 1) * bs]),
                            getattr(lora, "adapter_id", None),
                            getattr(lora, "name", None),
                        ),
                    )
                )
        for rid in self._finishing:
            self._requests.pop(rid, None)
        self._finishing.clear()
        if not own:
            return
        with self._lock:
            self._own.update(own)
            while len(self._own) > OWN_BLOCKS:
                self._own.popitem(last=False)

    # -- vLLM's side ----------------------------------------------------------
    def take_events(self) -> list[Any]:
        """BlockStored / BlockRemoved for what changed since the last call."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

        events: list[Any] = []
        with self._lock:
            for part, states in zip(self.parts, self._states, strict=True):
                for tier, state in states.items():
                    if not state.dirty:
                        continue
                    stored, removed = _settle(state)
                    medium, locality = MEDIUMS[tier]
                    if removed:
                        events.append(
                            BlockRemoved(
                                block_hashes=[ext(h) for h in removed],
                                medium=medium,
                                group_idx=part.group,
                                locality=locality,
                            )
                        )
                    for run in self._runs(stored):
                        own = run.own
                        events.append(
                            BlockStored(
                                block_hashes=[ext(h) for h in run.hashes],
                                parent_block_hash=(
                                    None
                                    if own is None or own.parent is None
                                    else ext(own.parent)
                                ),
                                token_ids=run.tokens,
                                block_size=0 if own is None else part.block_size,
                                lora_id=None if own is None else own.lora_id,
                                medium=medium,
                                lora_name=None if own is None else own.lora_name,
                                group_idx=part.group,
                                locality=locality,
                            )
                        )
        return events

    def _runs(self, stored: list[BlockHash]) -> list[_Run]:
        """Stored hashes in runs: chains of this engine's own blocks (each the
        parent of the next: one event, their tokens back to back, as vLLM's
        own), and every other block in one run without tokens."""
        runs: list[_Run] = []
        others = _Run([], None)
        for h in stored:
            own = self._own.pop(h, None)
            if own is None:
                others.hashes.append(h)
            elif runs and runs[-1].hashes[-1] == own.parent:
                runs[-1].hashes.append(h)
                runs[-1].tokens.extend(own.tokens)
            else:
                runs.append(_Run([h], own, list(own.tokens)))
        if others.hashes:
            runs.append(others)
        return runs

    def close(self) -> None:
        self._stop.set()
        for watch in list(self._watches.values()):
            watch.cancel()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._client.close()


def _settle(state: _TierState) -> tuple[list[BlockHash], list[BlockHash]]:
    """What vLLM must be told now (stored, removed); marks it told."""
    stored: list[BlockHash] = []
    removed: list[BlockHash] = []
    published = state.published
    for h, held in state.dirty.items():
        if held:
            if h not in published and len(published) < MAX_TRACKED:
                published.add(h)
                stored.append(h)
        elif h in published:
            published.discard(h)
            removed.append(h)
    state.dirty = {}
    return stored, removed


def watched_parts(groups: KVGroups, instance_id: str, stages: int) -> list[WatchedPart]:
    """The parts whose events are published: full-attention groups whose
    block is one hash block (their server hashes are vLLM's block hashes),
    of pipeline stage 0."""
    return [
        WatchedPart(
            groups.part_instance(instance_id, rule, 0, stages),
            rule.index,
            rule.block_size,
        )
        for rule in groups.rules
        if rule.kind == "full" and rule.block_size == groups.hash_block_size
    ]
