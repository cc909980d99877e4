"""The scheduler's prefix queries: how much of a waiting request the server
can restore, as leases per part (a hybrid model's KV cache groups and a
pipeline's stages are separate parts, kv_groups.py), and whether loading it
pays (fetch_plan.py). Runs on vLLM's scheduler thread: every call bounded, no
call at all while the server is known to be away, lease releases off-thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import PegaflowError, ServerUnavailable, UnknownInstance
from pegaflow.common.results import QueryResult

from .extra_config import ConnectorConfig
from .fetch_plan import FetchPlanner
from .kv_groups import GroupRule, KVGroups

logger = logging.getLogger(__name__)

# Boundaries asked for a Mamba state, from the longest hit down: states exist
# only where a step ended (vLLM's align mode), so a few tries find the last.
MAX_STATE_PROBES = 4


@dataclass(slots=True)
class Lease:
    group: int  # vLLM's kv_cache_group_id
    lease_id: int
    first: int  # the group block the lease's first block stands for
    count: int
    stage: int = 0  # the pipeline stage whose part it leases


@dataclass(slots=True)
class Hit:
    """One query's answer for a request not yet admitted."""

    local: int  # tokens vLLM had locally when asked
    limit: int  # tokens we asked about end here
    num_tokens: int  # hit beyond `local`
    leases: list[Lease]
    at: float
    is_async: bool = False


class Away(Exception):
    """The server is away or asked us to come back: no hit now."""


class PrefixQuery:
    def __init__(
        self,
        config: ConnectorConfig,
        instance_id: str,
        client: PegaflowClient,
        groups: KVGroups,
        stages: int,
        stage_groups: dict[int, frozenset[int]],
        stats: dict[str, float],
    ) -> None:
        """stage_groups: the scheduler's, filled as workers report; stats: the
        counters this adds to (the scheduler swaps in a new dict as it takes
        them)."""
        self.config = config
        self.instance_id = instance_id
        self.client = client
        self.groups = groups
        self.stages = stages
        self._stage_groups = stage_groups
        self.stats = stats
        # A hybrid model's hit is priced per part here, which would price a
        # Mamba state or a window's blocks as if they were the tokens they
        # hold: its hits always load.
        self.planner = FetchPlanner(
            config.fetch_planner == "auto" and not groups.hybrid, config.timeout_s
        )
        self._away_until = 0.0  # no queries before this (server away)
        self._releaser: ThreadPoolExecutor | None = None

    def query(self, request: Any, local: int, limit: int, now: float) -> Hit | None:
        miss = Hit(local, limit, 0, [], now)
        if (
            limit <= local
            or local % self.groups.alignment
            or now < self._away_until
            or self.config.mode == "save_only"
            or (self.stages > 1 and len(self._stage_groups) < self.stages)
        ):
            return miss
        leases: list[Lease] = []
        start = time.perf_counter()
        try:
            end = self._dense_hits(request, local, limit, leases)
            if end is not None and end > local:
                end = self._state_hits(request, local, end, leases)
        except Away:
            self.release_all(leases)
            return miss
        finally:
            self.stats["query_seconds"] += time.perf_counter() - start
        if end is None:  # a tier is still pulling blocks in: ask again
            self.release_all(leases)
            return None
        self.planner.forget(request.request_id)
        self.stats["query_tokens"] += limit - local
        if end <= local:
            self.release_all(leases)
            return miss
        return Hit(local, limit, end - local, leases, now)

    def _dense_hits(
        self, request: Any, local: int, end: int, leases: list[Lease]
    ) -> int | None:
        """The longest prefix every prefix-queried group holds beyond `local`
        (None: ask again later). A sliding-window group is asked for its whole
        prefix too, as its blocks are saved as they fill."""
        for rule in self.groups.rules:
            if rule.sparse:
                continue
            lo, hi = local // rule.block_size, end // rule.block_size
            answers = self._ask(request, rule, lo, hi)
            if answers is None:
                return None
            leases += answers
            held = min((lease.count for lease in answers), default=0)
            end = min(end, (lo + held) * rule.block_size)
            end -= end % self.groups.alignment
            if end <= local:
                return end
        return end

    def _state_hits(
        self, request: Any, local: int, end: int, leases: list[Lease]
    ) -> int | None:
        """The longest hit, at most `end`, at whose boundary every Mamba group
        holds its state; a few boundaries are tried from the top."""
        sparse = [rule for rule in self.groups.rules if rule.sparse]
        for _ in range(MAX_STATE_PROBES if sparse else 1):
            if end <= local:
                return end
            found: list[Lease] = []
            for rule in sparse:
                hi = end // rule.block_size
                answers = self._ask(request, rule, hi - 1, hi)
                if answers is None:
                    self.release_all(found)
                    return None
                found += answers
                if not all(lease.count for lease in answers):
                    break
            else:
                leases.extend(found)
                return end
            self.release_all(found)
            end -= self.groups.alignment
        return 0 if sparse else end

    def stages_of(self, group: int) -> list[int]:
        if self.stages == 1:
            return [0]
        return sorted(s for s, gs in self._stage_groups.items() if group in gs)

    def _ask(
        self, request: Any, rule: GroupRule, lo: int, hi: int
    ) -> list[Lease] | None:
        """Each stage's lease of this group's blocks [lo, hi) (count: the
        prefix it holds), or None while one is still pulling them in; Away
        when one cannot answer."""
        hashes = self.groups.hashes(rule, request.block_hashes)[lo:hi]
        answers: list[Lease] = []
        for stage in self.stages_of(rule.index):
            try:
                res = self._ask_part(request, rule, stage, hashes)
            except Away:
                self.release_all(answers)
                raise
            if res.loading:
                res = self._pulling(request, rule, stage, hashes, res)
            if res is None:
                self.release_all(answers)
                return None
            res = self._worth_loading(rule, res)
            answers.append(Lease(rule.index, res.lease_id, lo, res.num_blocks, stage))
        return answers

    def _pulling(
        self, request: Any, rule: GroupRule, stage: int, hashes: list[bytes], res: Any
    ) -> Any:
        """A tier pulls blocks in: None to wait for them, or the answer for
        the blocks L1 holds now when waiting would not pay."""
        est = self.planner.pulling(
            request.request_id,
            time.monotonic(),
            res.num_blocks,
            self._block_bytes(rule),
            rule.block_size,
            res.tier_gbps,
            res.l1_gbps,
        )
        if est.decision == "load":
            return None
        self.stats["planner_gave_up"] += est.load_s < est.compute_s
        self.stats["planner_recomputed_tokens"] += res.num_blocks * rule.block_size
        self.planner.forget(request.request_id)
        ready = min(res.ready_blocks, len(hashes))
        if not ready:
            return QueryResult(0, 0)
        # L1's blocks alone (the pull goes on: a later request may use it).
        res = self._ask_part(request, rule, stage, hashes[:ready])
        return None if res.loading else res

    def _worth_loading(self, rule: GroupRule, res: Any) -> Any:
        """The answer, or a miss when recomputing its hit would be sooner."""
        if not res.num_blocks:
            return res
        tokens = res.num_blocks * rule.block_size
        est = self.planner.ready(
            res.num_blocks, self._block_bytes(rule), rule.block_size, res.l1_gbps
        )
        if est.decision == "load":
            self.stats["planner_loaded_tokens"] += tokens
            self.stats["planner_predicted_load_seconds"] += est.load_s
            return res
        self.stats["planner_recomputed_tokens"] += tokens
        self.release_ids([res.lease_id])
        return QueryResult(0, 0)

    def _block_bytes(self, rule: GroupRule) -> int:
        """What one worker loads per block of the group (its stages load their
        own layers side by side)."""
        return rule.block_bytes // self.stages

    def _ask_part(
        self, request: Any, rule: GroupRule, stage: int, hashes: list[bytes]
    ) -> Any:
        instance = self.groups.part_instance(self.instance_id, rule, stage, self.stages)
        now = time.monotonic()
        try:
            self.stats["queries"] += 1
            # One hash function per engine: every hash has the first's length.
            return self.client.query(instance, hashes, hash_len=len(hashes[0]))
        except (ServerUnavailable, UnknownInstance) as exc:
            # Server away or our workers not (re-)registered yet: misses for a
            # while rather than a failed round trip per request per step.
            self.stats["query_failures"] += 1
            self._away_until = now + self.config.retry_interval_s
            logger.warning(
                "pegaflow query failed (%s); misses for %.1f s",
                exc,
                self.config.retry_interval_s,
            )
            raise Away from None
        except PegaflowError as exc:
            # About this request (a prompt over the server's block limit, the
            # lease cap reached): its miss alone, the next request asks.
            self.stats["query_failures"] += 1
            logger.warning(
                "pegaflow query for %s failed (%s); a miss", request.request_id, exc
            )
            raise Away from None

    def release_all(self, leases: list[Lease]) -> None:
        self.release_ids([lease.lease_id for lease in leases if lease.lease_id])

    def release_ids(self, ids: list[int]) -> None:
        if not ids:
            return
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(1, "pegaflow-release")
        for lease_id in ids:
            self._releaser.submit(self._release_now, lease_id)

    def _release_now(self, lease_id: int) -> None:
        try:
            self.client.release_lease(lease_id)
        except PegaflowError as exc:  # expired or server gone: nothing pinned
            logger.debug("release of lease %d: %s", lease_id, exc)

    def shutdown(self) -> None:
        if self._releaser is not None:
            self._releaser.shutdown(wait=True)
