"""Scheduler half: prefix queries, load plans, save intents, held blocks.

Runs in vLLM's engine-core process on the scheduler's thread, so every call is
bounded: one query per waiting request (answer reused while fresh), no call at
all while the server is known to be away, lease releases off-thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import PegaflowError, ServerUnavailable, UnknownInstance

from .extra_config import ConnectorConfig
from .step_plan import LoadJob, ReqId, SaveJob, StepPlan, WorkerReport, new_stats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Hit:
    """One query's answer for a request not yet admitted."""

    local: int  # blocks vLLM had locally when asked
    limit: int  # blocks we asked about end here
    num_blocks: int  # hit beyond `local`
    lease_id: int
    at: float
    is_async: bool = False


@dataclass(slots=True)
class _Req:
    request: Any  # vllm.v1.request.Request
    block_ids: list[int]
    saved: int  # blocks [0, saved) are cached, loaded or handed to a save
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
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        self.block_size = block_size
        self.num_workers = num_workers
        self.client = client or PegaflowClient(
            config.addr, timeout_s=config.query_timeout_s
        )
        self.stats = new_stats()
        self._reqs: dict[ReqId, _Req] = {}
        self._hits: dict[ReqId, _Hit] = {}
        self._loads: list[LoadJob] = []
        self._finish_saves: list[SaveJob] = []
        self._held: set[ReqId] = set()
        self._away_until = 0.0  # no queries before this (server away)
        self._releaser: ThreadPoolExecutor | None = None

    # -- admission ----------------------------------------------------------
    def num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        local = num_computed_tokens // bs
        # Never claim the last token: vLLM must compute one to sample from.
        limit = min((request.num_tokens - 1) // bs, len(request.block_hashes))
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
                self._release(hit.lease_id)
            hit = self._query(request, local, limit, now)
            if hit is None:
                return None, False  # the server is still pulling blocks in
            self._hits[request.request_id] = hit
        tokens = hit.num_blocks * bs
        hit.is_async = tokens > self.config.sync_load_max_tokens
        return tokens, hit.is_async

    def _query(self, request: Any, local: int, limit: int, now: float) -> _Hit | None:
        miss = _Hit(local, limit, 0, 0, now)
        if limit <= local or now < self._away_until or self.config.mode == "save_only":
            return miss
        hashes = request.block_hashes[local:limit]
        start = time.perf_counter()
        try:
            # One hash function per engine: every hash has the first's length.
            size = len(hashes[0]) if hashes else None
            res = self.client.query(self.instance_id, hashes, hash_len=size)
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
            return miss
        except PegaflowError as exc:
            # About this request (a prompt over the server's block limit, the
            # lease cap reached): its miss alone, the next request asks.
            self.stats["query_failures"] += 1
            logger.warning(
                "pegaflow query for %s failed (%s); a miss", request.request_id, exc
            )
            return miss
        finally:
            self.stats["queries"] += 1
            self.stats["query_seconds"] += time.perf_counter() - start
        if res.loading:
            return None
        self.stats["query_tokens"] += len(hashes) * self.block_size
        return _Hit(local, limit, res.num_blocks, res.lease_id, now)

    def after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _Req(request, [], 0)
        st.block_ids = list(block_ids)
        if hit is None:  # second call after an async load: nothing to plan
            return
        # Admission (again, after a preemption): what is cached needs no save.
        ext = num_external_tokens // self.block_size
        st.saved = hit.local + ext
        if ext and hit.lease_id:
            dst = st.block_ids[hit.local : hit.local + ext]
            self._loads.append(LoadJob(rid, hit.lease_id, dst, not hit.is_async))
            self.stats["hit_tokens"] += num_external_tokens
        else:
            self._release(hit.lease_id)

    # -- per step -----------------------------------------------------------
    def build_plan(self, so: Any) -> StepPlan:
        plan = StepPlan(
            self._loads,
            self._finish_saves,
            self._held,
            set(so.preempted_req_ids or ()),
        )
        self._loads, self._finish_saves, self._held = [], [], set()
        self._track_block_tables(so)
        for rid, num_new in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is not None:
                upto = st.request.num_computed_tokens + num_new
                self._plan_save(st, upto, plan.saves)
        return plan

    def _track_block_tables(self, so: Any) -> None:
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
        cached = so.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            st = self._reqs.get(rid)
            if st is None or new_ids is None:
                continue
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0])
            else:
                st.block_ids.extend(new_ids[0])

    def _plan_save(self, st: _Req, upto_tokens: int, out: list[SaveJob]) -> None:
        req = st.request
        if not self.config.save_decode:
            upto_tokens = min(upto_tokens, req.num_prompt_tokens)
        # Hashes exist only for blocks whose tokens are all known (under async
        # scheduling they lag a step); such blocks are saved a step later.
        done = min(
            upto_tokens // self.block_size, len(req.block_hashes), len(st.block_ids)
        )
        if done > st.saved:
            out.append(
                SaveJob(
                    req.request_id,
                    st.block_ids[st.saved : done],
                    list(req.block_hashes[st.saved : done]),
                )
            )
            st.saved = done
            st.pending += self.num_workers

    def on_worker_report(self, report: WorkerReport) -> None:
        if report.socket_path:  # a worker reached the server's socket
            self.client.use_socket()
        for rid, n in report.saves_done.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            st.pending -= n
            if st.finished and st.pending <= 0:
                del self._reqs[rid]

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """True (keep the blocks) only while saves of this request are pending."""
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        if hit is not None:
            self._release(hit.lease_id)
        st = self._reqs.get(rid)
        if st is None:
            return False
        st.finished = True
        st.block_ids = list(block_ids)
        upto = request.num_computed_tokens
        if request.status.name != "FINISHED_ABORTED":
            # The last sampled token's KV was never computed.
            upto = min(upto, request.num_tokens - 1)
        self._plan_save(st, upto, self._finish_saves)
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
        return stats

    def _release(self, lease_id: int) -> None:
        if not lease_id:
            return
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(1, "pegaflow-release")
        self._releaser.submit(self._release_now, lease_id)

    def _release_now(self, lease_id: int) -> None:
        try:
            self.client.release_lease(lease_id)
        except PegaflowError as exc:  # expired or server gone: nothing pinned
            logger.debug("release of lease %d: %s", lease_id, exc)

    def shutdown(self) -> None:
        for hit in self._hits.values():
            self._release(hit.lease_id)
        self._hits.clear()
        if self._releaser is not None:
            self._releaser.shutdown(wait=True)
        self.client.close()
