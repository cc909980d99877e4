"""The connector under vLLM 0.33's default on GPU: async scheduling, with its
AsyncScheduler stepped as the engine core's step_with_batch_queue does
(overlapped_engine.py). Each step N+1 is scheduled, and planned by the
connector, before step N's output (transfer reports, load failures, sampled
tokens) is known. Every restored page is checked byte for byte, the outputs
equal a run without the connector, and nothing is left held or leaked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.connector.conftest import needs_vllm
from tests.procs import ServerProc

needs_vllm()

from tests.connector.engine import BLOCK, vllm_config  # noqa: E402
from tests.connector.overlapped_engine import OverlappedEngine  # noqa: E402
from tests.connector.test_two_engines import hit_tokens, prompts  # noqa: E402

FAST = {"retry_interval_s": 0.2, "timeout_s": 5.0}


def engine(model: Path, extra: dict | None = None) -> OverlappedEngine:
    return OverlappedEngine(vllm_config(model, extra or FAST))


def serve(
    e: OverlappedEngine, batch: dict[str, list[int]], max_tokens: int = 4
) -> None:
    for rid, tokens in batch.items():
        e.add(rid, tokens, max_tokens)
    e.run()
    assert e.errors == []


def control(model: Path, batch: dict[str, list[int]], **kw: Any) -> dict:
    """The outputs without a connector (the same fake model)."""
    e = OverlappedEngine(vllm_config(model, connector=False))
    serve(e, batch, **kw)
    e.close()
    return e.outputs


@pytest.mark.parametrize("sync", [False, True], ids=["async_load", "sync_load_max"])
def test_engine_b_hits_what_engine_a_saved(
    pega_server: Callable[..., ServerProc], tiny_model: Path, sync: bool
) -> None:
    """A saves prompt and decode blocks, B loads them: pages right, outputs
    the control's. Between steps even with sync_load_max_tokens set (vLLM
    cannot recompute a failed sync load under async scheduling)."""
    server = pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096 if sync else 0}
    batch = prompts(21, n=4)
    a = engine(tiny_model, extra)
    serve(a, batch, max_tokens=20)
    assert a.overlaps > 0
    a.assert_clean()
    # prompt and decode blocks, each once
    assert a.counters()["save_blocks"] == sum(
        (len(t) + 19) // BLOCK for t in batch.values()
    )
    b = engine(tiny_model, extra)
    serve(b, batch, max_tokens=20)
    counters = b.counters()
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert counters["load_blocks"] * BLOCK == counters["hit_tokens"]
    assert counters["load_failures"] == 0
    assert b.seen_waiting_remote == set(batch)  # async loads, either way
    for rid, tokens in batch.items():  # only what was not loaded
        computed = [p for p in b.seqs[rid].computed if p < len(tokens)]
        assert len(computed) == len(tokens) - hit_tokens(tokens, len(tokens))
    assert a.outputs == b.outputs == control(tiny_model, batch, max_tokens=20)
    b.assert_clean()
    assert server.metric("pegaflow_active_leases") == 0
    a.close()
    b.close()


def test_hits_and_misses_load_while_others_decode(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """B decodes two misses; A's prompts (async loads) and two more misses
    join while they decode: steps with loads in flight carry decodes whose
    tokens are placeholders, and every page is right."""
    pega_server()
    saved = prompts(22, n=3)
    misses = prompts(23, n=4, base=40)
    early = dict(list(misses.items())[:2])
    a = engine(tiny_model)
    serve(a, saved)
    b = engine(tiny_model)
    overlapped: list[int] = []

    def note(so: Any) -> None:
        decodes = [r for r, n in so.num_scheduled_tokens.items() if r in early]
        if so.kv_connector_metadata.plan.loads and decodes:
            overlapped.append(len(decodes))

    b.after_schedule = note
    for rid, tokens in early.items():
        b.add(rid, tokens, max_tokens=16)
    while not all(len(b.outputs.get(rid, ())) >= 2 for rid in early):
        b.step()
    serve(b, {**saved, **dict(list(misses.items())[2:])})
    assert overlapped, "loads started beside decodes"
    assert b.seen_waiting_remote == set(saved)
    want = sum(hit_tokens(t, len(t)) for t in saved.values())
    assert b.counters()["hit_tokens"] == want
    assert b.counters()["load_failures"] == 0
    outputs = control(tiny_model, saved)
    outputs.update(control(tiny_model, early, max_tokens=16))
    outputs.update(control(tiny_model, dict(list(misses.items())[2:])))
    assert b.outputs == outputs
    b.assert_clean()
    a.close()
    b.close()


def test_chunked_prefills_and_decode_blocks_are_saved_once_and_hit(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """Prefills in chunks of 32 under a 64-token budget, decodes whose block
    hashes lag a step (their last token a placeholder when the next step is
    planned): every full block is saved once, B's hits beside its misses
    load right, and C hits A's and B's prompts and outputs, all but the
    last token's block."""
    pega_server()
    sched = {"long_prefill_token_threshold": 32, "max_num_batched_tokens": 64}
    saved, misses = prompts(31, n=2), prompts(32, n=2)
    a = OverlappedEngine(vllm_config(tiny_model, FAST, **sched))
    serve(a, saved, max_tokens=20)
    blocks = sum((len(t) + 19) // BLOCK for t in saved.values())
    assert a.counters()["save_blocks"] == blocks
    a.assert_clean()
    b = OverlappedEngine(vllm_config(tiny_model, FAST, **sched))
    serve(b, {**saved, **misses}, max_tokens=20)
    want = sum(hit_tokens(t, len(t)) for t in saved.values())
    assert b.counters()["hit_tokens"] == want
    assert b.outputs == control(tiny_model, {**saved, **misses}, max_tokens=20)
    b.assert_clean()
    c = engine(tiny_model)
    grown = {rid: t + b.outputs[rid] for rid, t in {**saved, **misses}.items()}
    serve(c, grown, max_tokens=2)
    want = sum((len(t) - 1) // BLOCK * BLOCK for t in grown.values())
    assert c.counters()["hit_tokens"] == want
    for e in (a, b, c):
        e.close()


@pytest.mark.parametrize("when", ["before_update", "between_steps", "failing"])
def test_a_request_aborted_while_its_load_runs(
    pega_server: Callable[..., ServerProc], tiny_model: Path, when: str
) -> None:
    """B aborts a hit in the step that loads it: after vLLM scheduled the
    next step, before that step's output came back (the engine core's
    aborts queue; failing: a load that fails, heard after the abort), or
    between two steps. Its blocks come back once the load is done; the
    others' outputs and pages are right."""
    from vllm.v1.request import RequestStatus

    server = pega_server()
    batch = prompts(24, n=3)
    a = engine(tiny_model)
    serve(a, batch)
    b = engine(tiny_model)
    victim = next(iter(batch))
    loading: list[int] = []
    aborted: list[int] = []

    def note(so: Any) -> None:
        for job in so.kv_connector_metadata.plan.loads:
            if job.req_id != victim:
                continue
            b.after_schedule = None
            loading.append(len(b.queue))
            if when != "between_steps":
                b.before_update = abort
            if when == "failing":
                job.lease_id ^= 2  # unknown to the server: the load fails

    def abort(_: Any = None) -> None:
        b.before_update = None
        aborted.append(len(b.queue))
        b.sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)

    b.after_schedule = note
    for rid, tokens in batch.items():
        b.add(rid, tokens, max_tokens=4)
    while not loading:
        b.step()
    if when == "between_steps":  # the engine core's input queue
        abort()
    b.run()
    assert b.errors == [] and aborted
    assert b.counters()["load_failures"] == (when == "failing")
    assert not b.scheduler_connector._scheduler._failed_loads  # gone with it
    rest = {rid: t for rid, t in batch.items() if rid != victim}
    outputs = control(tiny_model, rest)
    assert {rid: b.outputs[rid] for rid in rest} == outputs
    b.assert_clean()
    # (the lease the fault replaced stays the server's until it expires)
    assert server.metric("pegaflow_active_leases") == (when == "failing")
    a.close()
    b.close()


def test_a_request_aborted_while_its_saves_are_in_flight(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """The server stalls (SIGSTOP) while A prefills; one request is aborted
    after the next step was scheduled. vLLM keeps its blocks until its saves
    landed; C then hits exactly the blocks it had computed, bytes right."""
    import signal

    from vllm.v1.request import RequestStatus

    server = pega_server()
    batch = prompts(25, n=2)
    victim = next(iter(batch))
    # A deadline far past the steps below: a save that gave up would be
    # reported done, and the abort would then free the blocks at once.
    a = engine(tiny_model, {**FAST, "timeout_s": 60.0})

    def stop_before_the_first_saves(so: Any) -> None:
        # Stopped after the plan, before the worker sends a byte: stopped
        # after the step instead, the server could store the prefill first.
        if so.kv_connector_metadata.plan.saves:
            a.after_schedule = None
            server.proc.send_signal(signal.SIGSTOP)

    for rid, tokens in batch.items():
        a.add(rid, tokens, max_tokens=16)
    a.after_schedule = stop_before_the_first_saves
    try:
        while len(a.outputs.get(victim, ())) < 3:
            a.step()

        def abort(so: Any) -> None:
            a.before_update = None
            a.sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            held.update(a.sched.requests)

        held: set[str] = set()
        a.before_update = abort
        a.step()
        a.step()
        assert victim in held and victim in a.sched.requests  # its saves pend
    finally:
        server.proc.send_signal(signal.SIGCONT)
    a.run()
    assert a.errors == []
    a.assert_clean()
    kv_tokens = len(a.seqs[victim].tokens) - 1
    c = engine(tiny_model)
    serve(c, {victim: a.seqs[victim].tokens})
    assert c.counters()["hit_tokens"] == kv_tokens // BLOCK * BLOCK
    c.assert_clean()
    a.close()
    c.close()


@pytest.mark.parametrize("sync", [False, True], ids=["async_load", "sync_load_max"])
def test_a_failed_load_is_recomputed(
    pega_server: Callable[..., ServerProc], tiny_model: Path, sync: bool
) -> None:
    """B's load of A's prefix for "a" fails (a lease the server never gave);
    "b", with the same prefix, is admitted in the next step, scheduled
    before vLLM heard of the failure. vLLM's recompute policy computes "a"
    again: the outputs equal the control's, every page read is right, and C
    then hits both prompts whole (B saved what it recomputed or loaded).
    sync_load_max_tokens set: before, "a" loaded in the step that computed
    its tail, the next step was its first decode, and vLLM's recompute
    dropped the failed step's token but delivered that decode's, sampled
    over the hole (and left its placeholders unresolved: it scheduled two
    tokens past the ones it had). Now the load is between steps."""
    import random

    pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096 if sync else 0}
    rnd = random.Random(26)
    prefix = [rnd.randrange(50, 950) for _ in range(96)]  # 6 blocks
    batch = {rid: prefix + [rnd.randrange(50, 950) for _ in range(70)] for rid in "ab"}
    a = engine(tiny_model, extra)
    serve(a, {"prefix": prefix})
    b = engine(tiny_model, extra)
    seen: dict[str, Any] = {}

    def break_the_lease(so: Any) -> None:
        (job,) = so.kv_connector_metadata.plan.loads
        assert job.req_id == "a"
        seen["sync"] = job.sync
        job.lease_id ^= 2  # unknown to the server: the load fails
        b.add("b", batch["b"])  # admitted in the next schedule
        b.after_schedule = note_b

    def note_b(so: Any) -> None:
        if any(r.req_id == "b" for r in so.scheduled_new_reqs):
            seen["b_scheduled_with_queued"] = len(b.queue)
            b.after_schedule = None

    b.after_schedule = break_the_lease
    b.add("a", batch["a"])
    b.run()
    assert b.errors == []
    assert b.counters()["load_failures"] == 1
    computed = [p for p in b.seqs["a"].computed if p < len(batch["a"])]
    assert sorted(set(computed)) == list(range(len(batch["a"])))
    assert b.outputs == control(tiny_model, batch)
    assert seen == {"sync": False, "b_scheduled_with_queued": 1}
    b.assert_clean()
    c = engine(tiny_model, extra)
    serve(c, batch)
    assert c.counters()["hit_tokens"] == 2 * 160
    assert c.outputs == b.outputs
    for e in (a, b, c):
        e.close()


def test_preemption_keeps_bytes_right_and_leaks_nothing(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """A pool too small for every request's decode: vLLM preempts requests
    with a step in flight and resumes them, loading what they saved; saves
    of preempted requests end before their blocks are reused, and B hits
    what A saved."""
    pega_server()
    batch = prompts(28, n=4, base=60)
    a = OverlappedEngine(vllm_config(tiny_model, FAST, max_len=256), num_blocks=24)
    preempted: set[str] = set()
    for rid, tokens in batch.items():
        a.add(rid, tokens, max_tokens=60)
    while not a.idle():
        a.step()
        preempted |= {r.request_id for r in a.sched.waiting if r.num_preemptions}
    assert preempted, "the scenario must preempt"
    # resumed requests loaded the blocks they had saved
    assert a.seen_waiting_remote and a.seen_waiting_remote <= preempted
    assert a.counters()["hit_tokens"] > 0
    assert a.errors == []
    a.assert_clean()
    assert a.outputs == control(tiny_model, batch, max_tokens=60)
    b = OverlappedEngine(vllm_config(tiny_model, FAST, max_len=256), num_blocks=24)
    serve(b, batch, max_tokens=2)
    assert b.counters()["hit_tokens"] > 0
    b.assert_clean()
    a.close()
    b.close()
