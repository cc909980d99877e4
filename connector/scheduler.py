"""Scheduler half: admission of hits, load plans, save intents, held blocks.

Runs in vLLM's engine-core process on the scheduler's thread, so every call is
bounded: one query per waiting request and KV cache group (prefix_query.py;
the answer reused while fresh). A hybrid model's groups, and a pipeline's
stages, are separate parts on the server (kv_groups.py); a hit is the longest
prefix every part can restore. The stages' parts are known once a worker of
each stage reported them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pegaflow.client.pegaflow_client import PegaflowClient

from .extra_config import ConnectorConfig
from .kv_groups import NULL_BLOCK, GroupRule, KVGroups, single_group
from .prefix_query import Hit, Lease, PrefixQuery
from .step_plan import LoadJob, ReqId, SaveJob, StepPlan, WorkerReport, new_stats
from .vllm_compat import block_table_updates

logger = logging.getLogger(__name__)

# Orphaned holes tracked at most (block ids, all groups): past it, every local
# hit counts as reading one (its saves are dropped), as untracked ones may be.
MAX_ORPHANS = 1 << 16


@dataclass(slots=True)
class _Req:
    request: Any  # vllm.v1.request.Request
    tables: list[list[int]]  # block ids per transferred group (rule order)
    saved: list[int]  # per group: blocks [0, saved) are cached, loaded or saving
    # Per group: where the planned load starts; a failed load rewinds `saved`
    # here, as vLLM recomputes the blocks that did not arrive.
    load_from: list[int] | None = None
    pending: int = 0  # save-job reports still owed by the workers
    finished: bool = False


class SchedulerHalf:
    def __init__(
        self,
        config: ConnectorConfig,
        instance_id: str,
        block_size: int,
        num_workers: int,
        client: PegaflowClient | None = None,
        groups: KVGroups | None = None,
        stages: int = 1,
        overlapped: bool = True,
    ) -> None:
        self.config = config
        # vLLM schedules a step before the last one's output came back (async
        # scheduling, a pipeline's batch queue): hits never load synchronously
        # (num_new_matched_tokens).
        self.overlapped = overlapped
        if overlapped and config.sync_load_max_tokens:
            logger.warning(
                "pegaflow: sync_load_max_tokens is ignored with async "
                "scheduling (vLLM cannot recompute a failed sync load then): "
                "hits load between steps; --no-async-scheduling allows them"
            )
        self.instance_id = instance_id
        self.groups = groups or single_group(block_size)
        self.stages = stages
        # Pipeline stage -> the groups it has layers of, as its workers said.
        self._stage_groups: dict[int, frozenset[int]] = {}
        self.num_workers = num_workers
        self.client = client or PegaflowClient(
            config.addr,
            timeout_s=config.query_timeout_s,
            busy_poll_us=config.poll_us,
        )
        self.stats = new_stats()
        self.queries = PrefixQuery(
            config,
            instance_id,
            self.client,
            self.groups,
            stages,
            self._stage_groups,
            self.stats,
        )
        self.planner = self.queries.planner
        self._reqs: dict[ReqId, _Req] = {}
        self._hits: dict[ReqId, Hit] = {}
        self._loads: list[LoadJob] = []
        self._finish_saves: list[SaveJob] = []
        self._held: set[ReqId] = set()
        # Sync loads of the last two plans, whose blocks vLLM cached as it
        # allocated them; the readers of such blocks (StepPlan.readers).
        self._recent_sync: list[list[LoadJob]] = [[], []]
        self._readers: dict[ReqId, set[ReqId]] = {}
        # By owner and group (rule position): blocks of its failed sync load,
        # and those it computed over them before vLLM heard, that it has not
        # rewritten yet, which vLLM's recompute policy keeps in its prefix
        # cache; hits on them (owner, reader, group, blocks) settle in
        # build_plan, when it is known what the owner rewrites in that step.
        self._holes: dict[ReqId, dict[int, set[int]]] = {}
        self._rereads: list[tuple[ReqId, ReqId, int, set[int]]] = []
        # By group: holes of owners that finished (or were aborted) before
        # they rewrote them. vLLM frees them hashes and all, so they stay
        # hittable until it gives them to a request afresh; a hit on one
        # reads the hole, and its reader is poisoned outright (no owner left
        # to fail with: StepPlan.poisoned).
        self._orphans: dict[int, set[int]] = {}
        self._orphans_overflow = False
        self._poison: set[ReqId] = set()
        # Requests whose load failed: vLLM recomputes them, and asks us again;
        # a hit claimed again may fail the same way, forever.
        self._failed_loads: set[ReqId] = set()

    # -- admission ----------------------------------------------------------
    def num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._failed_loads:
            return 0, False
        local = num_computed_tokens
        # Never claim the last token: vLLM must compute one to sample from.
        known = len(request.block_hashes) * self.groups.hash_block_size
        limit = min(request.num_tokens - 1, known)
        limit -= limit % self.groups.alignment
        hit = self._hits.get(request.request_id)
        now = time.monotonic()
        if (
            hit is None
            or (hit.local, hit.limit) != (local, limit)
            or (now - hit.at > self.config.lease_reuse_s)
        ):
            if hit is not None:
                # Out of _hits before asking again: a `loading` answer stores
                # nothing, and request_finished must not release it twice.
                del self._hits[request.request_id]
                self.queries.release_all(hit.leases)
            hit = self.queries.query(request, local, limit, now)
            if hit is None:
                return None, False  # the server is still pulling blocks in
            self._hits[request.request_id] = hit
        # With several vLLM groups (a hybrid model, HiSparse) a failed load
        # is reported per request, which vLLM accepts only for async loads:
        # a sync load could not fail safely.
        # Nor with several workers: the step's forward runs on every rank and
        # stage, and a load failing on one leaves the others' KV (and their
        # saves of it) computed over the hole, which only that one knows of.
        # Nor with steps overlapped (async scheduling): vLLM 0.33 schedules
        # the request's next step before it hears of the failure, and its
        # recompute drops the failed step's token but delivers the next
        # one's, sampled over the hole (its placeholders never resolved).
        sync_max = self.config.sync_load_max_tokens
        if self.groups.several or self.num_workers > 1 or self.overlapped:
            sync_max = 0
        hit.is_async = hit.num_tokens > sync_max
        return hit.num_tokens, hit.is_async

    def after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external: int
    ) -> None:
        """vLLM allocated the request's blocks (one list per KV cache group)."""
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        st = self._reqs.get(rid)
        tables = [list(block_ids[rule.index]) for rule in self.groups.rules]
        if st is None:
            st = self._reqs[rid] = _Req(request, tables, [0] * len(tables))
        st.tables = tables
        if hit is None:  # second call after an async load: nothing to plan
            return
        if hit.local:
            self._note_reader(st, hit.local)
        # Admission (again, after a preemption): what is cached needs no save.
        end = hit.local + num_external
        st.saved = [end // rule.block_size for rule in self.groups.rules]
        st.load_from = [hit.local // rule.block_size for rule in self.groups.rules]
        if not num_external:
            self.queries.release_all(hit.leases)
            return
        jobs = self._load_jobs(st, hit, end)
        self._loads.extend(jobs)
        if jobs:
            self.stats["hit_tokens"] += num_external

    def _note_reader(self, st: _Req, local: int) -> None:
        """vLLM caches a sync load's blocks as it allocates them, so a request
        admitted after it may hit them locally: if that load failed, it read
        KV that never arrived, and must not save what it computed over it.
        In the same step: a reader (steps never overlap where loads are
        sync, so vLLM heard how the load went before the next). Later, vLLM
        evicted the blocks (policy "fail") or keeps them for their owner to
        recompute ("recompute": _holes); a hit on them reads them as the owner
        rewrites them in that step, or else reads the hole (_settle_holes)."""
        rid, rules = st.request.request_id, self.groups.rules
        for job in self._loads:
            if not job.sync or job.req_id == rid:
                continue
            pos = rules.index(self.groups.rule(job.group))
            if not set(job.block_ids).isdisjoint(
                st.tables[pos][: local // rules[pos].block_size]
            ):
                self._readers.setdefault(job.req_id, set()).add(rid)
        for owner, holes in self._holes.items():
            for pos, blocks in holes.items():
                hit = st.tables[pos][: local // rules[pos].block_size]
                if owner != rid and not blocks.isdisjoint(hit):
                    self._rereads.append((owner, rid, pos, blocks.intersection(hit)))
        # Nobody rewrites an orphan while it is hittable: a hit reads it.
        if self._orphans_overflow or any(
            not blocks.isdisjoint(st.tables[pos][: local // rules[pos].block_size])
            for pos, blocks in self._orphans.items()
        ):
            self._poison.add(rid)

    def _settle_holes(self, so: Any) -> None:
        """A request that hit a hole reads it unless its owner rewrites it
        whole in this step (attention writes a layer's KV before it reads
        it); what the owner rewrites is a hole no more."""
        for owner, rid, pos, blocks in self._rereads:
            if owner not in self._holes:  # it finished since: an orphan's reader
                self._poison.add(rid)
            elif not blocks.issubset(self._rewritten(so, owner, pos)):
                self._readers.setdefault(owner, set()).add(rid)
        self._rereads = []
        for owner, holes in list(self._holes.items()):
            for pos in list(holes):
                holes[pos] -= self._rewritten(so, owner, pos)
                if not holes[pos]:
                    del holes[pos]
            if not holes:
                del self._holes[owner]

    def _orphan_holes(self, owner: ReqId) -> None:
        """The owner is done before it rewrote its holes: they are orphans."""
        holes = self._holes.pop(owner, None)
        if not holes or self._orphans_overflow:
            return
        for pos, blocks in holes.items():
            self._orphans.setdefault(pos, set()).update(blocks)
        if sum(map(len, self._orphans.values())) > MAX_ORPHANS:
            logger.warning(
                "pegaflow: over %d blocks of failed loads are left in vLLM's "
                "prefix cache; requests that hit it locally save nothing now",
                MAX_ORPHANS,
            )
            self._orphans, self._orphans_overflow = {}, True

    def _drop_reallocated(self, so: Any) -> None:
        """Orphans vLLM gave to a request afresh (to load, or past what it
        has computed): it dropped their hashes then, so no later hit reads
        the hole. Whole tables (new, resumed) start with the request's hit."""
        computed = {
            new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs
        }
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        fresh = [(job.group, job.block_ids) for job in self._loads]
        for rid, ids, whole in block_table_updates(so):
            for rule in self.groups.rules:
                skip = computed[rid] // rule.block_size if whole else 0
                fresh.append((rule.index, ids[rule.index][skip:]))
        for group, ids in fresh:
            pos = self.groups.rules.index(self.groups.rule(group))
            if pos in self._orphans:
                self._orphans[pos].difference_update(ids)
        self._orphans = {pos: ids for pos, ids in self._orphans.items() if ids}

    def _rewritten(self, so: Any, rid: ReqId, pos: int) -> set[int]:
        """Blocks of a group that the request's forward writes whole in this
        step (vLLM advances num_computed_tokens after build_connector_meta)."""
        st, n = self._reqs.get(rid), so.num_scheduled_tokens.get(rid, 0)
        if st is None or not n:
            return set()
        start, bs = st.request.num_computed_tokens, self.groups.rules[pos].block_size
        return set(st.tables[pos][-(-start // bs) : (start + n) // bs])

    def _load_jobs(self, st: _Req, hit: Hit, end: int) -> list[LoadJob]:
        """Per group, the blocks vLLM allocated in the hit (its null blocks are
        what the group's window no longer needs), from that group's lease."""
        rid, jobs = st.request.request_id, []
        by_part = {(lease.stage, lease.group): lease for lease in hit.leases}
        for pos, rule in enumerate(self.groups.rules):
            table = st.tables[pos]
            lo = max(hit.local, rule.first_needed_token(end)) // rule.block_size
            hi = min(end // rule.block_size, len(table))
            wanted = [p for p in range(lo, hi) if table[p] != NULL_BLOCK]
            for stage in self.queries.stages_of(rule.index) if wanted else []:
                lease = by_part.pop((stage, rule.index), None)
                jobs.append(self._load_job(rid, rule, stage, lease, table, wanted, hit))
        self.queries.release_all(list(by_part.values()))  # what vLLM did not allocate
        return jobs

    def _load_job(
        self,
        rid: ReqId,
        rule: GroupRule,
        stage: int,
        lease: Lease | None,
        table: list[int],
        wanted: list[int],
        hit: Hit,
    ) -> LoadJob:
        first, last = wanted[0], wanted[-1]
        if (
            lease is None
            or first < lease.first
            or last >= lease.first + lease.count
            or last - first + 1 != len(wanted)
        ):
            # Not what was leased: a failed load (lease 0) of every block, so
            # vLLM recomputes them, never a partial restore.
            logger.warning(
                "pegaflow: %s group %d blocks %d..%d are not leased; "
                "recomputing the hit",
                rid,
                rule.index,
                first,
                last,
            )
            self.queries.release_all([lease] if lease else [])
            lease = Lease(rule.index, 0, first, len(wanted), stage)
        ids = [table[p] for p in wanted]
        return LoadJob(
            rid,
            lease.lease_id,
            ids,
            not hit.is_async,
            rule.index,
            first - lease.first,
            stage,
        )

    # -- per step -----------------------------------------------------------
    def build_plan(self, so: Any) -> StepPlan:
        self._settle_holes(so)
        if self._orphans:
            self._drop_reallocated(so)
        plan = StepPlan(
            self._loads,
            self._finish_saves,
            self._held,
            set(so.preempted_req_ids or ()),
            so.total_num_scheduled_tokens,
            self._readers,
            self._poison,
        )
        self._loads, self._finish_saves, self._held = [], [], set()
        self._poison = set()
        self._recent_sync = [
            self._recent_sync[-1],
            [job for job in plan.loads if job.sync],
        ]
        self._readers = {}
        block_state = getattr(so, "kv_connector_block_state", None)
        self._track_block_tables(so, block_state)
        handoffs = getattr(block_state, "boundary_state_offloads", None)
        for rid, num_new in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is not None:
                upto = st.request.num_computed_tokens + num_new
                states = None if handoffs is None else handoffs.get(rid, [])
                self._plan_save(st, upto, plan.saves, states)
        return plan

    def _track_block_tables(self, so: Any, block_state: Any) -> None:
        if block_state is not None:  # vLLM 0.33: the tables as they are now
            for rid, st in self._reqs.items():
                ids = block_state.get_block_ids(rid)
                if ids is not None:
                    st.tables = [list(ids[r.index]) for r in self.groups.rules]
            return
        for rid, ids, whole in block_table_updates(so):
            st = self._reqs.get(rid)
            if st is None:
                continue
            for pos, rule in enumerate(self.groups.rules):
                if whole:
                    st.tables[pos] = list(ids[rule.index])
                else:
                    st.tables[pos].extend(ids[rule.index])

    def _plan_save(
        self,
        st: _Req,
        upto_tokens: int,
        out: list[SaveJob],
        states: list[tuple[int, int, int]] | None = None,
    ) -> None:
        """Save jobs for what is computed once this step ran. `states`: vLLM
        0.33's exact Mamba boundary-state hand-offs; None where vLLM has none
        (a state is then the block ending at an aligned `upto_tokens`)."""
        req = st.request
        if not self.config.save_decode:
            upto_tokens = min(upto_tokens, req.num_prompt_tokens)
        for pos, rule in enumerate(self.groups.rules):
            # Hashes exist only for blocks whose tokens are all known (under
            # async scheduling they lag a step); such blocks are saved later.
            hashes = self.groups.hashes(rule, req.block_hashes)
            table, bs = st.tables[pos], rule.block_size
            done = min(upto_tokens // bs, len(hashes), len(table))
            if rule.sparse:
                aligned = upto_tokens % bs == 0
                picks = _state_blocks(rule, table, st.saved[pos], done, states, aligned)
            else:
                picks = [(p, table[p]) for p in range(st.saved[pos], done)]
            picks = [(p, b) for p, b in picks if b != NULL_BLOCK and p < done]
            if picks:
                ids = [b for _, b in picks]
                out.append(
                    SaveJob(
                        req.request_id, ids, [hashes[p] for p, _ in picks], rule.index
                    )
                )
                st.pending += self.num_workers
            st.saved[pos] = max(st.saved[pos], done)

    def on_worker_report(self, report: WorkerReport) -> None:
        if report.socket_path:  # a worker reached the server's socket
            self.client.use_socket()
        for stage, groups in report.stage_groups.items():
            self._stage_groups[stage] = frozenset(groups)
        # _failed_loads only of requests still here: one aborted while its
        # load ran already left (request_finished), and would never leave
        # that set again; its holes nobody rewrites are orphans.
        for rid in report.failed_loads:
            holes: dict[int, set[int]] = {}
            for job in self._recent_sync[0] + self._recent_sync[1]:
                if job.req_id == rid:  # its blocks stay cached, empty
                    pos = self.groups.rules.index(self.groups.rule(job.group))
                    holes.setdefault(pos, set()).update(job.block_ids)
            st = self._reqs.get(rid)
            if holes and st is not None and st.load_from is not None:
                # And the blocks it computed over them before vLLM heard
                # (cached as well): what it loaded or computed whole.
                for pos, (lo, hi) in enumerate(
                    zip(st.load_from, st.saved, strict=True)
                ):
                    holes.setdefault(pos, set()).update(st.tables[pos][lo:hi])
                    holes[pos].discard(NULL_BLOCK)
            for pos, blocks in holes.items():
                self._holes.setdefault(rid, {}).setdefault(pos, set()).update(blocks)
            if st is None or st.finished:  # aborted before it heard: orphans
                self._orphan_holes(rid)
                continue
            self._failed_loads.add(rid)
            # vLLM recomputes the blocks that did not load: save them
            # (the server may not hold them: it restarted, or evicted).
            if st.load_from is not None:
                pairs = zip(st.saved, st.load_from, strict=True)
                st.saved = [min(s, f) for s, f in pairs]
        self.planner.observe_prefill(report.forward_tokens, report.forward_seconds)
        for rid, n in report.saves_done.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            st.pending -= n
            if st.finished and st.pending <= 0:
                del self._reqs[rid]

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> bool:
        """True (keep the blocks) only while saves of this request are pending."""
        rid = request.request_id
        self._failed_loads.discard(rid)
        self._orphan_holes(rid)
        self.planner.forget(rid)
        hit = self._hits.pop(rid, None)
        if hit is not None:
            self.queries.release_all(hit.leases)
        st = self._reqs.get(rid)
        if st is None:
            return False
        st.finished = True
        st.tables = [list(block_ids[rule.index]) for rule in self.groups.rules]
        upto = request.num_computed_tokens
        if request.status.name != "FINISHED_ABORTED":
            # The last sampled token's KV was never computed.
            upto = min(upto, request.num_tokens - 1)
        self._plan_save(st, upto, self._finish_saves, states=[])
        if st.pending > 0:
            self._held.add(rid)
            return True
        del self._reqs[rid]
        return False

    # -- housekeeping -------------------------------------------------------
    def take_stats(self) -> dict[str, float] | None:
        if not any(self.stats.values()):
            return None
        stats, self.stats = self.stats, new_stats()
        self.queries.stats = self.stats
        return stats

    def shutdown(self) -> None:
        for hit in self._hits.values():
            self.queries.release_all(hit.leases)
        self._hits.clear()
        self.queries.shutdown()
        self.client.close()


def _state_blocks(
    rule: GroupRule,
    table: list[int],
    saved: int,
    done: int,
    states: list[tuple[int, int, int]] | None,
    aligned: bool,
) -> list[tuple[int, int]]:
    """(position, block id) of the Mamba states to save: vLLM's hand-offs of
    this group past `saved`, or, without them, the block ending at `done` when
    the step ended on its boundary (the state of any other block is stale)."""
    if states is None:
        return [(done - 1, table[done - 1])] if aligned and done > saved else []
    picks = []
    for group, block_id, boundary in states:
        if group == rule.index and boundary % rule.block_size == 0:
            pos = boundary // rule.block_size - 1
            if pos >= saved:
                picks.append((pos, block_id))
    return picks
