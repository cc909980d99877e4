"""The Engine (engine.py) stepped as vLLM 0.33's engine core steps a GPU
engine by default: async scheduling, `EngineCore.step_with_batch_queue` with a
batch queue of two. Its AsyncScheduler schedules step N+1 (and the connector
plans it in build_connector_meta) before update_from_output has step N's
output: N's transfer reports, load failures and sampled tokens. The worker
runs the steps in order, as the model runner does; it knows the token it
sampled in step N when it runs N+1, where the scheduler has only a placeholder
(num_output_placeholders), so the fake forward keeps the tokens itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from tests.connector.engine import Engine
from tests.connector.fake_kv import Seq


class OverlappedEngine(Engine):
    scheduler_cls = AsyncScheduler

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        # vLLM's batch_queue_size; a pipeline's is its stage count.
        self.queue_size = config.max_concurrent_batches
        assert self.queue_size == 2, "async scheduling is off"
        assert self.scheduler_connector is None or (
            self.scheduler_connector._scheduler.overlapped
        )
        self.queue: deque[tuple[Any, Any, Any]] = deque()
        # Test hook, (scheduler output about to be updated) -> None: what
        # vLLM's _process_aborts_queue does there (aborts that came in while
        # the step ran), after the next step was scheduled.
        self.before_update: Callable[[Any], None] | None = None
        self.updates = 0  # update_from_output calls
        self.overlaps = 0  # steps scheduled with another one's output pending

    def step(self) -> dict[str, Any]:
        """One call of step_with_batch_queue."""
        scheduled: dict[str, int] = {}
        if self.sched.has_requests():
            self.overlaps += bool(self.queue)
            so, tables, mro = self.execute()
            scheduled = dict(so.num_scheduled_tokens)
            self.queue.appendleft((so, tables, mro))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.queue) < self.queue_size and (
                executed or self.sched.has_requests()
            ):
                return {"scheduled": scheduled, "finished": {}}
        elif not self.queue:
            return {"scheduled": scheduled, "finished": {}}
        so, tables, mro = self.queue.pop()  # the oldest
        if self.before_update is not None:
            self.before_update(so)
        finished = self.update(so, tables, mro)
        self.updates += 1
        for rid in so.num_scheduled_tokens:
            req = self.sched.requests.get(rid)
            if req is not None and not req.is_finished():
                known, mine = list(req.all_token_ids), self.seqs[rid].tokens
                assert mine[: len(known)] == known, (
                    f"{rid}: vLLM's tokens {known[-3:]} (of {len(known)}) are "
                    f"not the worker's {mine[len(known) - 3 : len(known)]}"
                )
        return {"scheduled": scheduled, "finished": finished}

    def idle(self) -> bool:
        """Also no step's output pending."""
        return not (self.sched.has_requests() or self.queue)

    # -- the worker's tokens ------------------------------------------------
    def track_tokens(self, rid: str, seq: Seq) -> None:
        """The worker's own: the prompt and every token it sampled (vLLM
        delivers a preempted request's in-flight token, too)."""

    def _sample(self, rid: str) -> list[int]:
        seq = self.seqs[rid]
        end = self.sched.requests[rid].num_computed_tokens  # this step's end
        assert end <= len(seq.tokens), f"{rid}: computes a token it lacks"
        if end < len(seq.tokens):
            return []  # a prefill chunk (or a recompute): nothing sampled
        token = seq.value(end - 1) % 900 + 50
        seq.tokens.append(token)
        return [token]
