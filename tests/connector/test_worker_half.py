"""Worker half against a stand-in client, in the orders vLLM 0.33's model
runners call it: results (get_finished, load errors) after wait_for_save, and
before it when speculative decoding defers wait_for_save past the drafter
(gpu_model_runner's defer_kv_connector_finalize, gpu/model_runner's
defer_kv_finalize). Saves and loads end when the test says so."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from pegaflow.client.pegaflow_client import COPY_GRACE_S
from pegaflow.common.results import LoadBatchResult, LoadItemResult, SaveResult
from pegaflow.connector.extra_config import ConnectorConfig
from pegaflow.connector.step_plan import LoadJob, SaveJob, StepPlan
from pegaflow.connector.worker import WorkerHalf

LAYERS = 2


@dataclass
class StandInClient:
    """Saves block until `saves_may_end` is set; a load writes every layer's
    signal word (as the server does) after `load_s` and fails the items whose
    lease is in `gone_leases`."""

    signals: np.ndarray | None = None
    saves_may_end: threading.Event = field(default_factory=threading.Event)
    saved: list[list[int]] = field(default_factory=list)
    load_s: float = 0.0
    gone_leases: set[int] = field(default_factory=set)
    loads_started: int = 0

    def save(
        self, instance_id: str, block_ids: list[int], hashes: list[bytes], **kw: object
    ) -> SaveResult:
        assert self.saves_may_end.wait(10), "the test never let the save end"
        self.saved.append(list(block_ids))
        return SaveResult(len(block_ids), 0, 0)

    def load_many(
        self,
        instance_id: str,
        items: list,
        tp_rank: int = 0,
        layer_seq: int = 0,
        done_event: int = 0,
    ) -> LoadBatchResult:
        assert not done_event  # host KV: loads are answered done
        self.loads_started += 1
        time.sleep(self.load_s)
        if layer_seq and self.signals is not None:
            self.signals[:] = layer_seq
        results = tuple(
            LoadItemResult(0, 0, "items[i].lease_id: gone")
            if it.lease_id in self.gone_leases
            else LoadItemResult(len(it.block_ids), len(it.block_ids))
            for it in items
        )
        return LoadBatchResult(sum(r.loaded for r in results), 0, results)

    def close(self) -> None:
        pass


def make_worker(client: StandInClient, **options: object) -> WorkerHalf:
    worker = WorkerHalf(ConnectorConfig(**options), "engine", 0, 1, client=client)
    reg = worker.registrar
    reg.registered = True  # as after register(); no server to describe KV to
    reg.layer_signals = np.zeros(LAYERS, np.uint64)
    reg.layer_index = {f"layer.{i}": i for i in range(LAYERS)}
    client.signals = reg.layer_signals
    return worker


@pytest.fixture
def client() -> Iterator[StandInClient]:
    c = StandInClient()
    yield c
    c.saves_may_end.set()  # no pool thread left waiting on the test


def forward(worker: WorkerHalf) -> None:
    for i in range(LAYERS):
        worker.wait_for_layer(f"layer.{i}")


def until(condition: object, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.005)


@pytest.mark.parametrize("results_first", [True, False], ids=["spec", "plain"])
def test_held_request_is_not_finished_before_its_last_save(
    client: StandInClient, results_first: bool
) -> None:
    """Scenario (spec decoding): the step that plans a finished request's last
    save also tells the worker to report it once its saves are done. Asked
    for results before wait_for_save, the worker reported it at once (no save
    in flight yet); vLLM freed and reused its blocks while the server was still
    to copy them out, and stored another request's KV under its hashes."""
    worker = make_worker(client)
    plan = StepPlan(saves=[SaveJob("r", [5, 6], [b"a" * 32, b"b" * 32])], held={"r"})
    worker.start_load(plan, layer_waits=True)
    forward(worker)
    if results_first:
        sending, _ = worker.get_finished()
        assert "r" not in sending, "reported finished before its save started"
    worker.save(plan)
    sending, _ = worker.get_finished()
    assert "r" not in sending, "reported finished while its save is in flight"
    client.saves_may_end.set()
    until(lambda: client.saved)
    # The save's future ends just after the client returned: ask until it has.
    reported: set[str] = set()
    until(lambda: reported.update(worker.get_finished()[0]) or "r" in reported)
    assert client.saved == [[5, 6]]
    assert worker.take_report().saves_done == {"r": 1}
    assert not worker._saves and not worker._held
    worker.shutdown()


@pytest.mark.parametrize("results_first", [True, False], ids=["spec", "plain"])
def test_sync_load_failure_is_reported_in_its_own_step(
    client: StandInClient, results_first: bool
) -> None:
    """Scenario (spec decoding): a layer-wise sync load whose lease was gone
    lands every layer signal, so the forward never collects its failure; only
    wait_for_save did. Asked for load errors before it, the worker reported
    them a step late: the step sampled from blocks that never loaded."""
    client.gone_leases = {8}
    worker = make_worker(client)
    plan = StepPlan(
        loads=[
            LoadJob("ok", 7, [1, 2], sync=True),
            LoadJob("gone", 8, [3, 4], sync=True),
        ]
    )
    worker.start_load(plan, layer_waits=True)
    forward(worker)
    if not results_first:
        worker.save(plan)
    worker.get_finished()
    assert worker.take_load_errors() == {3, 4}
    if results_first:
        worker.save(plan)
    assert worker.take_load_errors() == set()  # reported once
    worker.shutdown()


def test_sync_load_slower_than_twice_a_short_deadline_is_waited_for(
    client: StandInClient,
) -> None:
    """Scenario: timeout_s 0.2 s; the worker gave up on a sync load after
    2 * 0.2 s and vLLM recomputed into blocks the server still wrote, as the
    client waits for the server's answer up to timeout_s + COPY_GRACE_S."""
    client.load_s = 0.8
    assert 2 * 0.2 < client.load_s < 0.2 + COPY_GRACE_S
    worker = make_worker(client, timeout_s=0.2)
    plan = StepPlan(loads=[LoadJob("r", 7, [1, 2], sync=True)])
    worker.start_load(plan, layer_waits=False)  # waits for the whole load
    assert worker.take_load_errors() == set()
    assert worker.stats["load_blocks"] == 2 and worker.stats["load_failures"] == 0
    worker.shutdown()


def test_sync_load_queued_behind_stalled_saves_is_cancelled_when_it_fails(
    client: StandInClient,
) -> None:
    """A sync load that never started (every pool thread in a stalled save)
    fails after the wait and is cancelled, so it can never write into blocks
    vLLM recomputes."""
    worker = make_worker(client, timeout_s=0.1)
    for step in range(3):  # one per pool thread
        plan = StepPlan(saves=[SaveJob(f"s{step}", [step], [bytes([step]) * 32])])
        worker.start_load(plan, layer_waits=True)
        worker.save(plan)
    until(lambda: len(worker._pool._threads) == 3)
    plan = StepPlan(loads=[LoadJob("r", 7, [9], sync=True)])
    start = time.monotonic()
    worker.start_load(plan, layer_waits=False)
    assert worker.take_load_errors() == {9}
    assert time.monotonic() - start >= 0.1 + COPY_GRACE_S - 0.05
    client.saves_may_end.set()
    until(lambda: len(client.saved) == 3)
    time.sleep(0.05)
    assert client.loads_started == 0
    worker.shutdown()
