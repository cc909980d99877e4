"""An async load started in a step without a forward (vLLM's
kv_connector_no_forward: start_load_kv, then get_finished at once) is waited
for, briefly, in that step's get_finished: reported there, its request is
scheduled in the next step instead of one later (issue 29: a server hit's
extra scheduler step in WAITING_FOR_REMOTE_KVS)."""

from __future__ import annotations

import pytest

from pegaflow.connector import worker as worker_module
from pegaflow.connector.step_plan import LoadJob, StepPlan
from pegaflow.connector.worker import SAME_STEP_WAIT_S
from tests.connector.test_worker_half import StandInClient, client, make_worker, until

__all__ = ["client"]  # the fixture


def test_async_load_of_a_step_without_forward_is_reported_in_that_step(
    client: StandInClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scenario: the step's only work is one request's async load (10 ms).
    Before: get_finished right after start_load found it in flight, and the
    request waited for a later step's report. (The bound is raised so that a
    busy host's thread scheduling cannot decide the outcome.)"""
    client.load_s = 0.01
    monkeypatch.setattr(worker_module, "SAME_STEP_WAIT_S", 60.0)
    worker = make_worker(client)
    plan = StepPlan(loads=[LoadJob("r", 7, [1, 2], sync=False)])
    worker.start_load(plan, layer_waits=False)
    worker.save(plan)
    assert worker.get_finished() == (set(), {"r"})
    worker.shutdown()


def test_async_load_beside_a_forward_is_not_waited_for(
    client: StandInClient,
) -> None:
    """A step with a forward reports its async loads when they are done, as
    before: other requests' outputs never wait for a load."""
    client.load_s = 1.0
    worker = make_worker(client)
    plan = StepPlan(loads=[LoadJob("r", 7, [1, 2], sync=False)], scheduled_tokens=8)
    worker.start_load(plan, layer_waits=False)
    worker.save(plan)
    assert worker.get_finished() == (set(), set())  # returned at once
    got: set[str] = set()
    until(lambda: got.update(worker.get_finished()[1]) or "r" in got)
    worker.shutdown()


def test_a_slow_async_load_is_waited_for_only_briefly(client: StandInClient) -> None:
    """Without a forward, too: a load longer than SAME_STEP_WAIT_S is reported
    in a later step, and the step returned after that bound."""
    client.load_s = 1.0
    assert client.load_s > 4 * SAME_STEP_WAIT_S
    worker = make_worker(client)
    plan = StepPlan(loads=[LoadJob("r", 7, [1, 2], sync=False)])
    worker.start_load(plan, layer_waits=False)
    worker.save(plan)
    assert worker.get_finished() == (set(), set())
    got: set[str] = set()
    until(lambda: got.update(worker.get_finished()[1]) or "r" in got)
    worker.shutdown()
