"""Worker half: registration, loads, saves, completion reports.

Byte movement is the server's job; this half only issues RPCs, off the engine's
thread (a small pool) so a step never waits on a save. It waits only where vLLM
needs the bytes: sync loads before the layers read them, and in-flight saves of
a preempted request before its blocks are reused. Every RPC has a deadline; a
failed call turns into misses, skipped saves and load errors (vLLM recomputes),
and a lost registration is retried in the background until the server is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any

from pegaflow.client import PegaflowClient
from pegaflow.errors import PegaflowError, ServerUnavailable, UnknownInstance

from .config import ConnectorConfig
from .plan import LoadJob, ReqId, StepPlan, WorkerReport, new_stats
from .registrar import Registrar

logger = logging.getLogger(__name__)

IO_THREADS = 2  # one save and one load in flight at once


class WorkerHalf:
    def __init__(
        self,
        config: ConnectorConfig,
        instance_id: str,
        tp_rank: int,
        tp_size: int,
        client: PegaflowClient | None = None,
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        self.tp_rank = tp_rank
        self.client = client or PegaflowClient(config.addr, timeout_s=config.timeout_s)
        self.stats = new_stats()
        self._stats_lock = threading.Lock()  # IO threads add to the counters
        self._pool = ThreadPoolExecutor(IO_THREADS, "pegaflow-io")
        self.registrar = Registrar(
            self.client, config, instance_id, tp_rank, tp_size, self._pool
        )
        self._saves: dict[ReqId, list[Future]] = {}  # in flight, per save job
        self._held: set[ReqId] = set()
        self._recving: dict[ReqId, tuple[LoadJob, Future]] = {}
        self._sync: list[tuple[LoadJob, Future]] = []
        self._errors: set[int] = set()
        self._report = WorkerReport()

    def register(
        self, kv_caches: dict[str, Any], num_blocks: int, vllm_config: Any
    ) -> None:
        """Describe the KV memory once and register; a server that is away
        now is retried from later steps (the engine runs with misses)."""
        self.registrar.describe(kv_caches, num_blocks, vllm_config)
        self.registrar.register_now()

    # -- per step -----------------------------------------------------------
    def handle_preemptions(self, plan: StepPlan) -> None:
        """A preempted request's blocks may be rewritten by this very step."""
        futures = [f for rid in plan.preempted for f in self._saves.get(rid, ())]
        if futures:
            wait_all(futures, timeout=2 * self.config.timeout_s)

    def start_load(self, plan: StepPlan, layer_waits: bool) -> None:
        self.registrar.tick()
        self._held |= plan.held
        for job in plan.loads:
            fut = self._submit(self._load, job)
            if job.sync:
                self._sync.append((job, fut))
            else:
                self._recving[job.req_id] = (job, fut)
        if not layer_waits:  # nothing will call wait_for_layer_load this step
            self.wait_sync_loads()

    def wait_sync_loads(self) -> None:
        """Sync loads complete as a whole: the first layer's wait covers all."""
        for job, fut in self._sync:
            if not self._finished_ok(fut, "load"):
                self._errors.update(job.block_ids)
        self._sync.clear()

    def save(self, plan: StepPlan) -> None:
        """One Save per step for every request's completed blocks."""
        self.wait_sync_loads()  # in case no layer asked (no forward this step)
        if not plan.saves:
            return
        ids = [b for job in plan.saves for b in job.block_ids]
        hashes = [h for job in plan.saves for h in job.hashes]
        wait_event = self.registrar.record_compute_done()
        fut = self._submit(self._save, ids, hashes, wait_event)
        for job in plan.saves:
            self._saves.setdefault(job.req_id, []).append(fut)

    def get_finished(self) -> tuple[set[ReqId], set[ReqId]]:
        for rid in list(self._saves):
            futures = self._saves[rid]
            done = [f for f in futures if f.done()]
            if done:
                self._report.saves_done[rid] = len(done)
                futures[:] = [f for f in futures if not f.done()]
            if not futures:
                del self._saves[rid]
        sending = {rid for rid in self._held if rid not in self._saves}
        self._held -= sending
        recving = set()
        for rid, (job, fut) in list(self._recving.items()):
            if fut.done():
                del self._recving[rid]
                recving.add(rid)
                if not self._finished_ok(fut, "load"):
                    self._errors.update(job.block_ids)
        return sending, recving

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        socket, self.registrar.new_query_socket = self.registrar.new_query_socket, ""
        self._report.query_socket = socket
        if not (self._report.saves_done or socket):
            return None
        report, self._report = self._report, WorkerReport()
        return report

    def take_stats(self) -> dict[str, float] | None:
        with self._stats_lock:
            if not any(self.stats.values()):
                return None
            stats, self.stats = self.stats, new_stats()
        return stats

    # -- RPCs, on the pool --------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def _load(self, job: LoadJob) -> None:
        if not self.registrar.registered:
            raise UnknownInstance("not registered with the server")
        start = time.perf_counter()
        res = self.client.load(
            self.instance_id, job.lease_id, job.block_ids, tp_rank=self.tp_rank
        )
        self._count(
            load_seconds=time.perf_counter() - start,
            load_blocks=res.loaded,
            load_bytes=res.bytes,
        )

    def _save(self, ids: list[int], hashes: list[bytes], wait_event: int) -> None:
        if not self.registrar.registered:
            self._count(saves_skipped=len(ids))  # a future miss, nothing more
            return
        start = time.perf_counter()
        extra = {"wait_event": wait_event} if wait_event else {}
        try:
            res = self.client.save(
                self.instance_id, ids, hashes, tp_rank=self.tp_rank, **extra
            )
        except PegaflowError as exc:
            self._failed("save", exc)
            return
        self._count(
            save_seconds=time.perf_counter() - start,
            save_blocks=res.stored,
            save_bytes=res.stored * self.registrar.slot_bytes,
        )

    def _count(self, **values: float) -> None:
        with self._stats_lock:
            for key, value in values.items():
                self.stats[key] += value

    def _finished_ok(self, fut: Future, op: str) -> bool:
        try:
            fut.result(timeout=2 * self.config.timeout_s)
        except PegaflowError as exc:
            self._failed(op, exc)
            return False
        except TimeoutError:
            self._failed(op, ServerUnavailable("no answer before the deadline"))
            return False
        return True

    def _failed(self, op: str, exc: PegaflowError) -> None:
        self._count(**{f"{op}_failures": 1})
        logger.warning("pegaflow %s failed: %s", op, exc)
        if isinstance(exc, ServerUnavailable | UnknownInstance):
            self.registrar.lost(str(exc))

    def shutdown(self) -> None:
        pending = [f for fs in self._saves.values() for f in fs]
        pending += [f for _, f in self._recving.values()] + [f for _, f in self._sync]
        wait_all(pending, timeout=2 * self.config.timeout_s)
        self.registrar.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
