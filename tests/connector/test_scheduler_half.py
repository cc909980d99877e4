"""Scheduler half against a scripted client and minimal request objects: the
contract details vLLM's scheduler cannot provoke with our server (e.g. a
`loading` answer) or that are easiest to state in isolation."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pegaflow.client.pegaflow_client import QueryResult
from pegaflow.common.errors import (
    InvalidRequest,
    Overloaded,
    ServerUnavailable,
    UnknownInstance,
)
from pegaflow.connector import scheduler
from pegaflow.connector.extra_config import ConnectorConfig
from pegaflow.connector.kv_groups import GroupRule, KVGroups
from pegaflow.connector.scheduler import SchedulerHalf
from pegaflow.connector.step_plan import StepPlan, WorkerReport

BS = 16


@dataclass
class FakeClient:
    answers: list[object] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    def query(
        self, instance_id: str, hashes: list[bytes], hash_len: int | None = None
    ) -> QueryResult:
        assert hash_len == len(hashes[0])  # the scheduler vouches for one length
        self.asked.append(len(hashes))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def release_lease(self, lease_id: int) -> None:
        self.released.append(lease_id)

    def close(self) -> None:
        pass


def request(rid: str, num_tokens: int, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        num_computed_tokens=computed,
        block_hashes=[bytes([i]) * 32 for i in range(num_tokens // BS)],
        status=SimpleNamespace(name="FINISHED_STOPPED"),
    )


def half(client: FakeClient, **options: object) -> SchedulerHalf:
    cfg = ConnectorConfig(retry_interval_s=60, **options)
    return SchedulerHalf(cfg, "engine", BS, num_workers=1, client=client)


def test_loading_asks_again_then_hits() -> None:
    client = FakeClient([QueryResult(0, 0, loading=True), QueryResult(3, 11)])
    s = half(client)
    req = request("r", 64)
    assert s.num_new_matched_tokens(req, 0) == (None, False)
    assert s.num_new_matched_tokens(req, 0) == (48, True)
    assert client.asked == [3, 3]  # 64 tokens = 4 blocks, the last never claimed


def test_zero_is_never_async_and_local_hits_are_not_asked() -> None:
    client = FakeClient([QueryResult(0, 0)])
    s = half(client)
    assert s.num_new_matched_tokens(request("a", 64), 0) == (0, False)
    # Everything but the last block is local already: nothing to ask.
    assert s.num_new_matched_tokens(request("b", 64), 48) == (0, False)
    assert client.asked == [3]


@pytest.mark.parametrize("overlapped", [False, True])
def test_small_hits_load_synchronously_unless_steps_overlap(overlapped: bool) -> None:
    """With async scheduling vLLM cannot recompute a failed sync load (it
    delivers the next step's token, sampled over the hole): hits load
    between steps whatever sync_load_max_tokens says."""
    client = FakeClient([QueryResult(2, 5), QueryResult(3, 6)])
    cfg = ConnectorConfig(retry_interval_s=60, sync_load_max_tokens=32)
    s = SchedulerHalf(
        cfg, "engine", BS, num_workers=1, client=client, overlapped=overlapped
    )
    assert s.num_new_matched_tokens(request("a", 100), 0) == (32, overlapped)
    assert s.num_new_matched_tokens(request("b", 100), 0) == (48, True)


def test_answer_reused_while_fresh_and_released_when_unused() -> None:
    client = FakeClient([QueryResult(3, 21), QueryResult(1, 22)])
    s = half(client)
    req = request("r", 64)
    assert s.num_new_matched_tokens(req, 0) == (48, True)
    assert s.num_new_matched_tokens(req, 0) == (48, True)  # no side effects
    assert client.asked == [3]
    assert s.num_new_matched_tokens(req, 16) == (16, True)  # new local hit: ask
    s.request_finished(req, ([],))  # aborted before admission
    s.shutdown()
    assert sorted(client.released) == [21, 22]


def test_server_away_means_misses_without_asking() -> None:
    client = FakeClient([ServerUnavailable("down")])
    s = half(client)
    assert s.num_new_matched_tokens(request("a", 64), 0) == (0, False)
    assert s.num_new_matched_tokens(request("b", 64), 0) == (0, False)
    assert client.asked == [3]
    assert s.stats["query_failures"] == 1


def test_admission_plans_load_and_saves_the_rest() -> None:
    client = FakeClient([QueryResult(2, 9)])
    s = half(client)
    req = request("r", 80)
    assert s.num_new_matched_tokens(req, 0) == (32, True)
    s.after_alloc(req, ([10, 11, 12, 13, 14],), 32)
    req.num_computed_tokens = 32
    so = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[
            SimpleNamespace(req_id="r", block_ids=([10, 11, 12, 13, 14],))
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={"r": 48},
        total_num_scheduled_tokens=48,
    )
    plan = s.build_plan(so)
    assert [(j.lease_id, j.block_ids, j.sync) for j in plan.loads] == [
        (9, [10, 11], False)
    ]
    assert [j.block_ids for j in plan.saves] == [[12, 13, 14]]
    # The request finishes with its save in flight: blocks are held ...
    req.num_computed_tokens = 80
    assert s.request_finished(req, ([10, 11, 12, 13, 14],)) is True
    assert s.build_plan(
        SimpleNamespace(
            **{**vars(so), "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0}
        )
    ).held == {"r"}
    # ... until the worker reports the save; then nothing is left.
    s.on_worker_report(WorkerReport({"r": 1}))
    assert not s._reqs


def test_finished_delays_freeing_only_while_saves_are_pending() -> None:
    s = half(FakeClient([QueryResult(0, 0), QueryResult(0, 0)]))
    req = request("r", 40)
    s.num_new_matched_tokens(req, 0)
    s.after_alloc(req, ([1, 2, 3],), 0)
    req.num_computed_tokens = 20  # one full block has KV, never saved yet
    assert s.request_finished(req, ([1, 2, 3],)) is True
    s.on_worker_report(WorkerReport({"r": 1}))
    assert not s._reqs
    other = request("q", 40)
    s.num_new_matched_tokens(other, 0)
    s.after_alloc(other, ([4, 5, 6],), 0)
    assert s.request_finished(other, ([4, 5, 6],)) is False  # no KV: nothing pending


def test_stale_hit_asked_again_while_loading_is_released_once() -> None:
    """Scenario: a fresh answer's lease was released when the request's local
    prefix changed, and the new answer was `loading`; the stale answer stayed
    and request_finished released its lease a second time."""
    client = FakeClient([QueryResult(3, 21), QueryResult(0, 0, loading=True)])
    s = half(client)
    req = request("r", 64)
    assert s.num_new_matched_tokens(req, 0) == (48, True)
    assert s.num_new_matched_tokens(req, 16) == (None, False)  # ask again later
    s.request_finished(req, ([],))  # aborted while the server pulls blocks in
    s.shutdown()
    assert client.released == [21]


def test_a_per_request_query_error_is_that_requests_miss_alone() -> None:
    """Scenario: one prompt over the server's block limit (INVALID_ARGUMENT)
    or a lease cap reached (RESOURCE_EXHAUSTED) made every request a miss for
    retry_interval_s; only an unreachable server or unregistered workers do."""
    client = FakeClient(
        [
            InvalidRequest("block_hashes: 9000 blocks exceed 8192 per request"),
            Overloaded("RESOURCE_EXHAUSTED: 4096 leases active"),
            QueryResult(2, 7),
            UnknownInstance("FAILED_PRECONDITION: engine is not registered"),
        ]
    )
    s = half(client)
    assert s.num_new_matched_tokens(request("long", 64), 0) == (0, False)
    assert s.num_new_matched_tokens(request("capped", 64), 0) == (0, False)
    assert s.num_new_matched_tokens(request("next", 64), 0) == (32, True)
    assert s.num_new_matched_tokens(request("early", 64), 0) == (0, False)
    assert s.num_new_matched_tokens(request("after", 64), 0) == (0, False)
    assert client.asked == [3, 3, 3, 3]  # "after" was not asked: away
    assert s.stats["query_failures"] == 3


def test_the_planner_recomputes_a_slow_hit_but_a_hybrid_model_loads() -> None:
    """An L1 hit the server copies at 1 MB/s (3 MiB: 3 s) against a prefill of
    1M tokens/s (48 tokens: 48 us): recomputed, its lease released. A hybrid
    model's parts are not priced (a window's blocks are not their tokens):
    the same answers load."""
    cfg = ConnectorConfig(retry_interval_s=60)
    slow = [QueryResult(3, 11, 30.0, l1_gbps=1e-3), QueryResult(3, 12, 30.0)]
    full = GroupRule(0, "full", BS, 0, ("l0",), block_bytes=1 << 20)
    window = GroupRule(1, "sliding", BS, 2 * BS, ("l1",), block_bytes=1 << 20)
    prefill = WorkerReport(forward_tokens=1_000_000, forward_seconds=1.0)

    client = FakeClient(slow[:1])
    dense = KVGroups((full,), BS, BS)
    s = SchedulerHalf(cfg, "engine", BS, num_workers=1, client=client, groups=dense)
    s.on_worker_report(prefill)
    assert s.num_new_matched_tokens(request("r", 64), 0) == (0, False)
    s.shutdown()  # the release is off-thread: done once shut down
    assert client.released == [11]
    assert s.stats["planner_recomputed_tokens"] == 48

    client = FakeClient(list(slow))
    hybrid = KVGroups((full, window), BS, BS)
    s = SchedulerHalf(cfg, "engine", BS, num_workers=1, client=client, groups=hybrid)
    s.on_worker_report(prefill)
    assert s.num_new_matched_tokens(request("r", 64), 0) == (48, True)
    assert s.stats["planner_recomputed_tokens"] == 0


def test_a_load_failing_after_its_request_was_aborted_is_forgotten() -> None:
    """A request aborted while its async load runs leaves (request_finished);
    the load's failure, reported afterwards, put it back in the set of
    requests never to be offered a hit again, where it stayed for good."""
    s = half(FakeClient([QueryResult(2, 9)]))
    req = request("r", 80)
    assert s.num_new_matched_tokens(req, 0) == (32, True)
    s.after_alloc(req, ([10, 11, 12, 13, 14],), 32)
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    s.request_finished(req, ([10, 11, 12, 13, 14],))
    s.on_worker_report(WorkerReport(failed_loads={"r"}))
    assert not s._failed_loads
    live = request("q", 80)  # a live request's failure is kept: no hit again
    s.after_alloc(live, ([1, 2, 3, 4, 5],), 0)
    s.on_worker_report(WorkerReport(failed_loads={"q"}))
    assert s._failed_loads == {"q"}


def _new_req_step(s: SchedulerHalf, rid: str, ids: list[int], **also: int) -> StepPlan:
    """One step that admits `rid` with these blocks, computing 48 tokens (and
    `also` of running requests)."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    scheduled = {rid: 48, **also}
    return s.build_plan(
        SimpleNamespace(
            preempted_req_ids=set(),
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(ids,))],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
        )
    )


def _failed_sync_load() -> tuple[SchedulerHalf, SimpleNamespace]:
    """ "a" sync-loads blocks 10, 11 in a step of its own."""
    client = FakeClient([QueryResult(2, 9)] + [QueryResult(0, 0)] * 4)
    cfg = ConnectorConfig(retry_interval_s=60, sync_load_max_tokens=64)
    s = SchedulerHalf(cfg, "engine", BS, num_workers=1, client=client, overlapped=False)
    a = request("a", 80)
    assert s.num_new_matched_tokens(a, 0) == (32, False)
    s.after_alloc(a, ([10, 11, 12, 13, 14],), 32)
    plan = _new_req_step(s, "a", [10, 11, 12, 13, 14])
    assert [j.sync for j in plan.loads] == [True]
    return s, a


def _admit_hit(s: SchedulerHalf, rid: str, ids: list[int], **also: int) -> dict:
    """`rid` hits blocks 10, 11 in vLLM's prefix cache: the step's readers."""
    req = request(rid, 80)
    assert s.num_new_matched_tokens(req, 32) == (0, False)
    s.after_alloc(req, ([10, 11, *ids],), 0)
    return _new_req_step(s, rid, [10, 11, *ids], **also).readers


@pytest.mark.parametrize(
    ("failed", "owner_tokens", "readers"),
    [
        (True, 0, {"a": {"c"}}),
        (True, 16, {"a": {"c"}}),
        (True, 48, {}),
        (False, 0, {}),
    ],
)
def test_a_next_step_local_hit_on_a_sync_load_reads_it_unless_its_owner_rewrites(
    failed: bool, owner_tokens: int, readers: dict
) -> None:
    """ "c", admitted the step after "a"'s sync load, hits its blocks in vLLM's
    prefix cache. Steps do not overlap (sync loads never do): the load's
    outcome is known: if it failed, vLLM rewound "a" to recompute the
    blocks, and "c" reads them as "a" writes them in that step, if it
    writes both (not when it is not scheduled, or its chunk ends in 10)."""
    s, a = _failed_sync_load()
    if failed:
        a.num_computed_tokens = 0  # vLLM rewinds it to the first failed block
        s.on_worker_report(WorkerReport(failed_loads={"a"}))
    also = {"a": owner_tokens} if owner_tokens else {}
    assert _admit_hit(s, "c", [20, 21, 22], **also) == readers


def test_a_failed_sync_loads_blocks_are_read_until_their_owner_rewrote_them() -> None:
    """vLLM's ordinary scheduler recomputes a failed sync load a chunk a step
    (long_prefill_token_threshold), the blocks cached all along: a request
    admitted while one is not rewritten yet reads it, however many steps
    after the load."""
    s, a = _failed_sync_load()
    a.num_computed_tokens = 0
    s.on_worker_report(WorkerReport(failed_loads={"a"}))
    assert _admit_hit(s, "c", [20, 21, 22], a=16) == {"a": {"c"}}  # 10 rewritten
    a.num_computed_tokens = 16
    assert _admit_hit(s, "d", [30, 31, 32]) == {"a": {"d"}}  # 11 is not
    assert _admit_hit(s, "e", [40, 41, 42], a=16) == {}  # 11 rewritten now
    a.num_computed_tokens = 32
    assert _admit_hit(s, "f", [50, 51, 52]) == {}


def _admit(s: SchedulerHalf, rid: str, hit: list[int], fresh: list[int]) -> StepPlan:
    """`rid` hits `hit` in vLLM's prefix cache and gets `fresh` allocated."""
    req, ids = request(rid, 80), [*hit, *fresh]
    assert s.num_new_matched_tokens(req, len(hit) * BS) == (0, False)
    s.after_alloc(req, (ids,), 0)
    new = SimpleNamespace(
        req_id=rid, block_ids=(ids,), num_computed_tokens=len(hit) * BS
    )
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    return s.build_plan(
        SimpleNamespace(
            preempted_req_ids=set(),
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={rid: 16},
            total_num_scheduled_tokens=16,
        )
    )


def _aborted_owner(cap: int, monkeypatch: pytest.MonkeyPatch) -> SchedulerHalf:
    """ "a"'s sync load of blocks 10, 11 failed (it computed 12 over them) and
    "a" was aborted before it recomputed any."""
    monkeypatch.setattr(scheduler, "MAX_ORPHANS", cap)
    s, a = _failed_sync_load()
    a.num_computed_tokens = 0
    s.on_worker_report(WorkerReport(failed_loads={"a"}))
    a.status = SimpleNamespace(name="FINISHED_ABORTED")
    s.request_finished(a, ([10, 11, 12, 13, 14],))  # held: a save in flight
    return s


def test_an_aborted_owners_holes_poison_their_readers_until_vllm_reuses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nobody rewrites them while vLLM keeps them cached: a hit on any reads
    it (poisoned: no owner left to fail with). Given out afresh (vLLM dropped
    its hash then), a block is a hole no more."""
    s = _aborted_owner(64, monkeypatch)
    assert s._orphans == {0: {10, 11, 12}}
    plan = _admit(s, "c", [10], [20])
    assert (plan.poisoned, plan.readers) == ({"c"}, {})
    assert _admit(s, "d", [], [12, 21]).poisoned == set()  # vLLM reused 12
    assert s._orphans == {0: {10, 11}}
    assert _admit(s, "e", [30, 31], [32]).poisoned == set()  # no hole hit
    assert _admit(s, "f", [10, 11], [40]).poisoned == {"f"}


def test_holes_past_the_cap_poison_every_local_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_ORPHANS they are not told apart: any local hit may read one."""
    s = _aborted_owner(2, monkeypatch)
    assert s._orphans == {}
    assert _admit(s, "c", [30], [31]).poisoned == {"c"}
    assert _admit(s, "d", [], [32]).poisoned == set()
