"""Worker half: registration, loads, saves, completion reports.

Byte movement is the server's job; this half only issues RPCs, off the engine's
thread (a small pool) so a step never waits on a save. It waits only where vLLM
needs the bytes: sync loads before the layers read them, and in-flight saves of
a preempted request before its blocks are reused. Every RPC has a deadline; a
failed call turns into misses, skipped saves and load errors (vLLM recomputes),
and a lost registration is retried in the background until the server is back.

Per step: one Save for every request's completed blocks, and one Load for every
request's leases -- two when the step has both sync and async loads, so the
forward never waits for an async load's bytes. A step with no forward (vLLM
only starts the loads of requests it admitted) waits briefly for its async
loads in get_finished, so a done load's request is scheduled in the next step.
A lease that is gone fails only its own request's blocks
(get_block_ids_with_load_errors); a failed call fails every request it carried.

Replicated KV (MLA: every rank holds the same latent cache) is stored once: each
rank saves the stripe [tp_rank::tp_size] of the step's blocks, and every rank
loads every block.

A hybrid model's KV cache groups are separate parts on the server, one
registration each (kv_groups.py); a step's Save and Load go to each part in
turn, and a request whose load failed in any group fails in all of them. Under
pipeline parallelism a worker registers, saves and loads its own stage's
layers only; every worker sees the same plan and reports every job.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Any

from pegaflow.client.host_share import SharedMemory
from pegaflow.client.pegaflow_client import COPY_GRACE_S, PegaflowClient
from pegaflow.common.errors import ServerUnavailable

from .extra_config import ConnectorConfig
from .forward_timer import ForwardTimer
from .io_threads import io_pool
from .kv_groups import KVGroups, single_group
from .registrar import Registrar
from .server_calls import ServerCalls
from .step_plan import LoadJob, ReqId, SaveJob, StepPlan, WorkerReport

logger = logging.getLogger(__name__)

IO_THREADS = 3
TIMINGS_EVERY_S = 0.5  # forward timings are reported at most this often
SPINS = 2000  # polls of a layer signal word before napping between polls
NAP_S = 50e-6  # a save, a sync load and an async load in flight at once
# A step with no forward (only async loads started) waits this long for them
# in get_finished: a load done by then is reported in this step, so vLLM
# schedules its request in the next one instead of a step later.
SAME_STEP_WAIT_S = 0.05
# The longest a step's start waits for its sync load's I/O thread to take over
# (one busy with another call keeps it waiting; the layer waits cover the rest).
HANDOFF_WAIT_S = 0.005


class WorkerHalf:
    def __init__(
        self,
        config: ConnectorConfig,
        instance_id: str,
        tp_rank: int,
        tp_size: int,
        client: PegaflowClient | None = None,
        groups: KVGroups | None = None,
        stage: int = 0,
        stages: int = 1,
        settle_saves: bool = False,
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        # The step's Save ends before the step does: vLLM may hand out blocks
        # that Save reads and rewrite them (zero them) before the next step's
        # handle_preemptions, as vLLM 0.33's V2 model runner does.
        self.settle_saves = settle_saves
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.stage = stage
        self.stages = stages
        self.groups = groups or single_group(1)
        self.client = client or PegaflowClient(
            config.addr, timeout_s=config.timeout_s, busy_poll_us=config.poll_us
        )
        self._pool = io_pool(IO_THREADS, "pegaflow-io")
        # One registration per KV cache group, by vLLM's group id.
        self.parts = {
            rule.index: Registrar(
                self.client,
                config,
                self.groups.part_instance(instance_id, rule, stage, stages),
                tp_rank,
                tp_size,
                self._pool,
                rule if self.groups.hybrid or stages > 1 else None,
            )
            for rule in self.groups.rules
        }
        self._calls = ServerCalls(
            self.client, tp_rank, self.parts, config.loads_in_flight
        )
        # Until a Save ended, per save job: from start_load on, as vLLM may ask
        # get_finished before wait_for_save (speculative decoding defers that
        # past the drafter); a planned save's future ends with its Save's.
        self._saves: dict[ReqId, list[Future]] = {}
        self._planned: tuple[StepPlan, Future] | None = None  # not submitted yet
        self._held: set[ReqId] = set()
        # Async loads: a request's jobs (one per group) and their Load future.
        self._recving: dict[ReqId, tuple[list[LoadJob], Future]] = {}
        # Sync loads of this step: jobs, the Load future, its layer_seq (0: the
        # forward waits for the whole load at its first layer).
        self._sync: list[tuple[list[LoadJob], Future, int]] = []
        self._layer_seq = 0
        # Async loads of a step without a forward: get_finished waits for them.
        self._settle: list[Future] = []
        self._forward_timer: ForwardTimer | None = None
        self._timings_due = 0.0  # forward timings ride a report at most this often
        # Saves of blocks vLLM may free while their request runs (a window
        # moved on, an older Mamba state): the next forward may reuse them.
        self._volatile: list[Future] = []
        # How long a wait for a Save or Load may take before it counts as lost:
        # never shorter than the client's own bound (its deadline plus the
        # grace in which a started copy still writes), as vLLM reuses the
        # blocks once we give up; twice the deadline leaves room for a call
        # that queued behind another on the pool.
        self._transfer_wait_s = max(
            2 * config.timeout_s, config.timeout_s + COPY_GRACE_S
        )
        self._errors: set[int] = set()
        # Several vLLM groups (a hybrid model, HiSparse): block ids repeat
        # across groups, so vLLM takes load failures per request
        # (failed_recving), not per block.
        self._failed_reqs: set[ReqId] = set()
        # Requests whose sync load failed, and those that read its blocks
        # (StepPlan.readers): the forwards that read them (that step, and
        # with async scheduling the next, scheduled before vLLM saw the
        # failure) computed their blocks over KV that never arrived. Never saved
        # again (a miss, not wrong KV under good hashes); forgotten once vLLM
        # says they finished.
        self._poisoned: set[ReqId] = set()
        self._report = WorkerReport()
        # Host KV's sealed memfds, by the regions they back (registrar.py).
        self._shares: dict[tuple[tuple[int, int], ...], SharedMemory | None] = {}

    @property
    def registrar(self) -> Registrar:
        """The first group's registration (the only one but for hybrids)."""
        return self.parts[self.groups.rules[0].index]

    def register(
        self, kv_caches: dict[str, Any], num_blocks: int, vllm_config: Any
    ) -> None:
        """Describe the KV memory once and register; a server that is away
        now is retried from later steps (the engine runs with misses)."""
        # One group on one stage: the only registration of this KV in the
        # process, so its layer signal words may share the KV's memfd.
        alone = not self.groups.hybrid and self.stages == 1
        for rule in self.groups.rules:
            if self.groups.several or self.stages > 1:
                names = set(rule.layer_names)
                layers = {k: v for k, v in kv_caches.items() if k in names}
            else:
                layers = kv_caches
            if not layers:  # none of this group's layers on this stage
                del self.parts[rule.index]
                continue
            part = self.parts[rule.index]
            part.describe(layers, num_blocks, vllm_config, shared_signals=alone)
        for part in self.parts.values():  # now, before any forward writes KV
            part.back_with_memfd(self._shares, with_signals=alone)
        self._report.stage_groups = {self.stage: tuple(sorted(self.parts))}
        for part in self.parts.values():
            part.register_now()

    # -- per step -----------------------------------------------------------
    def handle_preemptions(self, plan: StepPlan) -> None:
        """Before the step's forward: a preempted request's blocks, and blocks
        vLLM freed while their request runs, may be rewritten by it (by the
        V2 runner's zeroing even before this: see settle_saves)."""
        futures = [f for rid in plan.preempted for f in self._saves.get(rid, ())]
        futures += self._volatile
        self._volatile = []
        if futures:
            wait_all(futures, timeout=self._transfer_wait_s)

    def step_began(self, plan: StepPlan) -> None:
        """Before the step's forward: time it, unless a sync load is in it."""
        sync = any(job.sync for job in plan.loads)
        self._timer().start(plan, 0 if sync else plan.scheduled_tokens)

    def start_load(self, plan: StepPlan, layer_waits: bool) -> None:
        for part in self.parts.values():
            part.tick()
        self._plan_saves(plan)  # before any get_finished can see plan.held
        self._held |= plan.held
        # Every rank of the stage loads every job of its parts; the others'
        # requests are still reported (vLLM waits for every worker).
        mine = [
            j for j in plan.loads if j.stage == self.stage and j.group in self.parts
        ]
        sync = [job for job in mine if job.sync]
        later = [job for job in mine if not job.sync]
        if sync:  # first: the forward waits for it
            seq = 0
            signals = all(len(p.layer_signals) for p in self.parts.values())
            if layer_waits and signals:
                self._layer_seq += 1
                seq = self._layer_seq
            sent = threading.Event()
            self._sync.append(
                (sync, self._submit(self._calls.load, sync, seq, sent), seq)
            )
            if seq:
                # The forward reads layer 0 within ~1 ms, and the Load is not
                # out until the I/O thread runs, which needs this thread's GIL
                # and (vLLM pins the worker to its cores) often its CPU: both
                # are handed over now, by waiting, not at Python's next switch
                # interval or a layer wait's nap (the server's copy started
                # ~2.4 ms late on the CPU engine, the forward waiting for it).
                sent.wait(HANDOFF_WAIT_S)
        async_reqs = {job.req_id for job in plan.loads if not job.sync}
        if async_reqs:
            fut = self._submit(self._calls.load, later) if later else _done(set())
            if not plan.scheduled_tokens:  # nothing else runs in this step
                self._settle.append(fut)
            for rid in async_reqs:
                jobs = [job for job in later if job.req_id == rid]
                self._recving[rid] = (jobs, fut)
        if not layer_waits:  # nothing will call wait_for_layer_load this step
            self.wait_sync_loads()

    def wait_for_layer(self, layer_name: str) -> None:
        """Until this layer of the step's sync loads has landed: its signal
        word holds the load's seq (the server writes it per layer), or the load
        ended (a failure is collected by wait_sync_loads: vLLM recomputes)."""
        part = self._part_of(layer_name)
        layer = None if part is None else part.layer_index.get(layer_name)
        if layer is None or any(seq == 0 for _, _, seq in self._sync):
            self.wait_sync_loads()  # a load without layer signals: all of it
            return
        word = part.layer_signals[layer : layer + 1]
        deadline = time.monotonic() + self._transfer_wait_s
        for _, fut, seq in self._sync:
            spins = 0
            while word[0] < seq and not fut.done():
                spins += 1
                if spins > SPINS:  # a layer takes ~0.1-1 ms: spin, then nap
                    if time.monotonic() > deadline:
                        self.wait_sync_loads()  # marks it failed, after its deadline
                        return
                    time.sleep(NAP_S)

    def _part_of(self, layer_name: str) -> Registrar | None:
        for part in self.parts.values():
            if layer_name in part.layer_index:
                return part
        return None

    def wait_sync_loads(self) -> None:
        """Sync loads complete as a whole: the first layer's wait covers all."""
        for jobs, fut, _ in self._sync:
            failed = self._load_failures(fut, jobs)
            self._fail_requests(jobs, failed)
            self._poisoned |= {job.req_id for job in jobs} & failed
        self._sync.clear()

    def _fail_requests(self, jobs: list[LoadJob], failed: set[ReqId]) -> None:
        """A request whose load failed in any group fails in every group (vLLM
        recomputes it): never a partial restore."""
        self._report.failed_loads |= {job.req_id for job in jobs} & failed
        if self.groups.several:
            self._failed_reqs |= {job.req_id for job in jobs} & failed
            return
        for job in jobs:
            if job.req_id in failed:
                self._errors.update(job.block_ids)

    def save(self, plan: StepPlan) -> None:
        """One Save per step for every request's completed blocks (this rank's
        stripe of them for replicated KV)."""
        self.wait_sync_loads()  # in case no layer asked (no forward this step)
        for rid, readers in plan.readers.items():
            if rid in self._poisoned:  # they read its blocks in this forward
                self._poisoned |= readers
        self._poisoned |= plan.poisoned
        self._timer().stop(plan)
        self._plan_saves(plan)  # a no-op when start_load saw this plan
        assert self._planned is not None
        _, planned = self._planned
        self._planned = None
        saves = plan.saves
        if self._poisoned:  # their blocks may hold KV computed over a hole
            saves = [job for job in saves if job.req_id not in self._poisoned]
            dropped = [job for job in plan.saves if job.req_id in self._poisoned]
            if dropped:
                self._calls.count(saves_skipped=sum(len(j.block_ids) for j in dropped))
        batches = []
        for group, part in self.parts.items():
            jobs = [job for job in saves if job.group == group]
            ids, hashes = self._stripe(part, jobs)
            if ids:
                batches.append((part, ids, hashes, part.record_compute_done()))
        if not batches:  # still reported done, as every rank's save is
            planned.set_result(None)
            return
        fut = self._submit(self._calls.save_parts, batches)
        fut.add_done_callback(lambda _: planned.set_result(None))
        if self.settle_saves and any(job.req_id not in plan.held for job in saves):
            # Blocks of running requests (a held one's are vLLM's to keep):
            # a preemption or a moved window frees them to the next step.
            wait_all([fut], timeout=self._transfer_wait_s)
        elif any(self.groups.rule(job.group).volatile for job in saves):
            self._volatile.append(fut)

    def _plan_saves(self, plan: StepPlan) -> None:
        """The plan's save jobs are in flight from now on: a request whose
        blocks vLLM holds for us is never reported finished before its last
        Save ended."""
        if self._planned is not None:
            if self._planned[0] is plan:
                return
            self._skip_planned()
        planned: Future = Future()
        for job in plan.saves:
            self._saves.setdefault(job.req_id, []).append(planned)
        self._planned = (plan, planned)

    def _skip_planned(self) -> None:
        """A plan whose wait_for_save never came (vLLM 0.33 has no such path):
        its saves are skipped, a future miss, rather than its requests held
        for good."""
        if self._planned is None:
            return
        plan, planned = self._planned
        self._planned = None
        self._calls.count(saves_skipped=sum(len(job.block_ids) for job in plan.saves))
        planned.set_result(None)

    def _stripe(
        self, part: Registrar, saves: list[SaveJob]
    ) -> tuple[list[int], list[bytes]]:
        ids = [b for job in saves for b in job.block_ids]
        hashes = [h for job in saves for h in job.hashes]
        if part.replicated:
            # Every rank sees the same plan, so the stripes partition the step.
            step = part.tp_size
            return ids[self.tp_rank :: step], hashes[self.tp_rank :: step]
        return ids, hashes

    def get_finished(
        self, finished_req_ids: set[ReqId] = frozenset()
    ) -> tuple[set[ReqId], set[ReqId]]:
        self._poisoned -= finished_req_ids
        if self._settle:  # bounded: a longer load is reported in a later step
            wait_all(self._settle, timeout=SAME_STEP_WAIT_S)
            self._settle = []
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
        for rid, (jobs, fut) in list(self._recving.items()):
            if fut.done():
                del self._recving[rid]
                recving.add(rid)
                # _load reports failures, never raises
                self._fail_requests(jobs, fut.result())
        return sending, recving

    def take_failed_requests(self) -> set[ReqId]:
        """Requests among the last get_finished's whose load failed (hybrid)."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def take_load_errors(self) -> set[int]:
        # This step's sync loads first: vLLM may ask before wait_for_save (spec
        # decoding), and a failure reported a step late is a sampled token
        # computed from blocks that never loaded.
        self.wait_sync_loads()
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        socket = ""
        for part in self.parts.values():
            socket = socket or part.new_socket_path
            part.new_socket_path = ""
        self._report.socket_path = socket
        report = self._report
        tokens, seconds = self._timer().take()
        # A stage computes its layers of every token: its share of the model
        # (summed over stages and ranks, the rate is the whole model's).
        report.forward_tokens += tokens / self.stages
        report.forward_seconds += seconds
        now = time.monotonic()
        timings_due = report.forward_tokens and now >= self._timings_due
        if not (
            report.saves_done
            or socket
            or report.stage_groups
            or report.failed_loads
            or timings_due
        ):
            return None
        if report.forward_tokens:
            self._timings_due = now + TIMINGS_EVERY_S
        report, self._report = self._report, WorkerReport()
        return report

    def _timer(self) -> ForwardTimer:
        if self._forward_timer is None:
            device = next(iter(self.parts.values())).device
            if not any(part.registered for part in self.parts.values()):
                return ForwardTimer()  # not registered yet: times nothing kept
            self._forward_timer = ForwardTimer(device)
        return self._forward_timer

    @property
    def stats(self) -> dict[str, float]:
        return self._calls.stats

    def take_stats(self) -> dict[str, float] | None:
        return self._calls.take_stats()

    # -- RPCs, on the pool --------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def _load_failures(self, fut: Future, jobs: list[LoadJob]) -> set[ReqId]:
        """Wait for a Load (at least as long as the client would); all its
        jobs fail when it does not end in time."""
        try:
            return fut.result(timeout=self._transfer_wait_s)
        except TimeoutError:
            # A Load still queued behind other calls never starts once
            # cancelled; one that started late may still write, and vLLM
            # reuses the blocks once they failed: it gets its own bound.
            if not fut.cancel():
                with contextlib.suppress(TimeoutError):
                    return fut.result(timeout=self.config.timeout_s + COPY_GRACE_S)
            self._calls.failed(
                "load", ServerUnavailable("no answer before the deadline")
            )
            return {job.req_id for job in jobs}

    def shutdown(self) -> None:
        self._skip_planned()
        pending = [f for fs in self._saves.values() for f in fs]
        pending += [f for _, f in self._recving.values()]
        pending += [f for _, f, _ in self._sync]
        wait_all(pending, timeout=self._transfer_wait_s)
        for part in self.parts.values():
            part.close()
        for shared in self._shares.values():
            if shared is not None:
                shared.close()  # the descriptor: the tensors keep the mapping
        # Let go of them too: while one lives its pages count as in use
        # (pegaflow.client.host_share), and no later engine of this process
        # could share them.
        self._shares.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _done(result: Any) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut
