"""What the scheduler half tells the workers each step, and what the workers
report back. Plain picklable dataclasses without vLLM types, so the worker half
runs (and is tested on a GPU machine) without vLLM installed; connector.py wraps
them in vLLM's metadata classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pegaflow.common.keys import BlockHash

ReqId = str


@dataclass(slots=True)
class LoadJob:
    """Load leased blocks [lease_offset, lease_offset + len(block_ids)) of one
    KV cache group into these engine blocks."""

    req_id: ReqId
    lease_id: int
    block_ids: list[int]
    sync: bool  # True: before this step's forward; False: between steps
    group: int = 0  # vLLM's kv_cache_group_id
    lease_offset: int = 0
    stage: int = 0  # the pipeline stage whose workers load it


@dataclass(slots=True)
class SaveJob:
    """Engine blocks whose KV is complete after this step, with their hashes."""

    req_id: ReqId
    block_ids: list[int]
    hashes: list[BlockHash]
    group: int = 0  # vLLM's kv_cache_group_id


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Requests whose blocks vLLM keeps for us: report each in finished_sending
    # once its saves are done.
    held: set[ReqId] = field(default_factory=set)
    # Preempted since the last step: their blocks may be reused by this step.
    preempted: set[ReqId] = field(default_factory=set)
    # Tokens the step computes (its forward is timed: forward_timer.py).
    scheduled_tokens: int = 0
    # By request: others that read blocks its sync load fills (or failed to
    # fill, before it recomputed them), hit in vLLM's own prefix cache; they
    # fail with that load (scheduler.py, _note_reader).
    readers: dict[ReqId, set[ReqId]] = field(default_factory=dict)
    # Requests that read blocks of a failed sync load whose owner is gone
    # (it never rewrote them): never saved again.
    poisoned: set[ReqId] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.held or self.preempted)


# Counters both halves keep; summed across workers and steps.
STAT_KEYS = (
    "queries",
    "query_seconds",
    "query_failures",
    "query_tokens",
    "hit_tokens",
    "load_blocks",
    "load_bytes",
    "load_seconds",
    "load_failures",
    "layerwise_loads",
    "save_blocks",
    "save_bytes",
    "save_seconds",
    "save_failures",
    "saves_skipped",
    "planner_loaded_tokens",
    "planner_recomputed_tokens",
    "planner_predicted_load_seconds",
    "planner_gave_up",
)


def new_stats() -> dict[str, float]:
    return dict.fromkeys(STAT_KEYS, 0)


@dataclass(slots=True)
class WorkerReport:
    """Per step from each worker: save jobs finished (or failed) per request,
    so the scheduler knows which requests still have saves in flight."""

    saves_done: dict[ReqId, int] = field(default_factory=dict)
    # After a (re-)registration: the server's query socket, so the scheduler's
    # queries skip gRPC (only RegisterInstance names it).
    socket_path: str = ""  # the server's unix socket, once a worker learnt it
    # Once, after registering: pipeline stage -> the KV cache groups it has
    # layers of (a stage may have none of a group's layers).
    stage_groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Requests whose load failed here (vLLM recomputes them): no more hits.
    failed_loads: set[ReqId] = field(default_factory=set)
    # Prefill steps timed since the last report (forward_timer.py).
    forward_tokens: float = 0.0
    forward_seconds: float = 0.0

    def merge(self, other: WorkerReport) -> WorkerReport:
        merged = dict(self.saves_done)
        for req_id, n in other.saves_done.items():
            merged[req_id] = merged.get(req_id, 0) + n
        stages = {**self.stage_groups, **other.stage_groups}
        return WorkerReport(
            merged,
            self.socket_path or other.socket_path,
            stages,
            self.failed_loads | other.failed_loads,
            self.forward_tokens + other.forward_tokens,
            self.forward_seconds + other.forward_seconds,
        )
