"""The server misbehaving under a running vLLM engine: slow saves, a crash
mid-run, absence at start and a restart. Nothing hangs, vLLM recomputes what
could not be loaded, and hits resume once the server is back."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.connector.conftest import needs_vllm
from tests.procs import ServerProc

needs_vllm()

from tests.connector.engine import BLOCK, Engine, vllm_config  # noqa: E402
from tests.connector.test_two_engines import IN_TURN, prompts, serve  # noqa: E402

FAST = {"retry_interval_s": 0.2, "timeout_s": 5.0}


def step_until(engine: Engine, done: Callable[[], bool], limit_s: float = 20) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "condition not reached"
        engine.step()
        time.sleep(0.01)


@pytest.mark.parametrize("spec_decode_order", [False, True], ids=["plain", "spec"])
def test_request_finishing_before_its_save_keeps_blocks_until_saved(
    pega_server: Callable[..., ServerProc], tiny_model: Path, spec_decode_order: bool
) -> None:
    """The server stalls (SIGSTOP) while requests decode: they finish with saves
    in flight, vLLM keeps their blocks, and frees them once the saves land (also
    when results are collected before wait_for_save, as with spec decoding)."""
    server = pega_server()
    a = Engine(vllm_config(tiny_model, FAST), spec_decode_order=spec_decode_order)
    batch = prompts(5, n=2)  # 100 and 117 tokens
    # 16 decode tokens fill one more block of each (112, 128) while the server is
    # stopped, so a save is surely pending when they finish: prefill saves alone
    # may land before the SIGSTOP.
    for rid, tokens in batch.items():
        a.add(rid, tokens, max_tokens=16)
    a.step()  # admitted: queries are done
    server.proc.send_signal(signal.SIGSTOP)
    try:
        step_until(
            a,
            lambda: (
                set(a.outputs) == set(batch)
                and all(len(v) == 16 for v in a.outputs.values())
            ),
        )
        held = [r for r in a.sched.requests.values() if r.is_finished()]
        assert {r.request_id for r in held} == set(batch)
        free = a.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free < a.kv_cache_config.num_blocks - 1
    finally:
        server.proc.send_signal(signal.SIGCONT)
    a.run()
    a.assert_clean()
    assert a.errors == []
    b = Engine(vllm_config(tiny_model, FAST))  # what was saved is A's bytes
    serve(b, {f"{rid}-b": t for rid, t in batch.items()})
    assert b.counters()["hit_tokens"] > 0
    a.close()
    b.close()


def test_server_killed_during_loads_means_recompute(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    server = pega_server()
    batch = prompts(6)
    a = Engine(vllm_config(tiny_model, FAST))
    serve(a, batch)
    b = Engine(vllm_config(tiny_model, FAST))

    def kill_once(so: object) -> None:
        if so.kv_connector_metadata.plan.loads:
            server.stop(signal.SIGKILL)
            b.after_schedule = None

    b.after_schedule = kill_once
    start = time.monotonic()
    serve(b, batch)  # pages checked: recomputed after the failed loads
    assert time.monotonic() - start < 30
    counters = b.counters()
    assert counters["load_failures"] > 0 and counters["load_blocks"] == 0
    assert b.seen_waiting_remote == set(batch)
    assert all(
        len([p for p in b.seqs[rid].computed if p < len(t)]) == len(t)
        for rid, t in batch.items()
    )
    serve(b, prompts(7))  # and it keeps serving, with misses
    b.assert_clean()
    a.close()
    b.close()


def test_absent_then_restarted_server_reregisters_and_hits_resume(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    a = Engine(vllm_config(tiny_model, FAST))  # no server yet: starts anyway
    registrar = a.worker._worker.registrar
    assert not registrar.registered
    serve(a, prompts(8))
    assert a.counters()["saves_skipped"] > 0

    server = pega_server()
    step_until(a, lambda: registrar.registered)
    serve(a, prompts(9))
    b = Engine(vllm_config(tiny_model, FAST))
    serve(b, {f"{rid}-b": t for rid, t in prompts(9).items()})
    assert b.counters()["hit_tokens"] > 0

    server.stop(signal.SIGKILL)
    serve(a, prompts(10))  # misses, skipped saves, no hang
    serve(b, prompts(11))
    pega_server()  # same port, empty pool
    step_until(a, lambda: registrar.registered)
    step_until(b, lambda: b.worker._worker.registrar.registered)
    serve(a, prompts(12))
    before = b.counters()["hit_tokens"]
    time.sleep(0.3)  # B's query back-off from the outage has passed
    serve(b, {f"{rid}-b": t for rid, t in prompts(12).items()})
    assert b.counters()["hit_tokens"] > before
    a.assert_clean()
    b.assert_clean()
    a.close()
    b.close()


def test_a_failed_sync_load_saves_nothing_computed_over_it(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """A sync load fails (the server answers; the lease is not one it gave)
    and the step's forward computes the prompt's next blocks over KV that
    never arrived. Those blocks were saved under their good hashes, and a
    third engine hit them. Now nothing of that request is saved again: C
    hits only what A saved (the failed request's blocks are a miss)."""
    import random

    pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096}
    rnd = random.Random(5)
    prefix = [rnd.randrange(50, 950) for _ in range(96)]  # 6 blocks
    longer = prefix + [rnd.randrange(50, 950) for _ in range(70)]
    a = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    serve(a, {"a": prefix})
    b = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    b.step()
    broke: dict[str, object] = {}

    def break_the_lease(so: object) -> None:
        plan = so.kv_connector_metadata.plan  # type: ignore[attr-defined]
        for job in plan.loads:
            if job.req_id == "b" and job.sync:
                job.lease_id ^= 2  # unknown to the server: the item fails
                broke["saves"] = [s.req_id for s in plan.saves]
                b.after_schedule = None

    b.after_schedule = break_the_lease
    b.add("b", longer, max_tokens=2)
    b.run()
    assert broke["saves"] == ["b"]  # the step planned saves of b's new blocks
    assert b.counters()["load_failures"] == 1
    assert b.counters().get("save_blocks", 0) == 0
    c = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    c.step()
    serve(c, {"c": longer})
    assert c.counters()["hit_tokens"] == len(prefix)
    for engine in (a, b, c):
        engine.close()


def test_a_failed_async_load_saves_the_blocks_it_recomputes(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """B's async load of A's prefix fails: the server restarted, empty, between
    B's query and its load. vLLM recomputes the prefix, and B saves it with the
    rest of its prompt: C then hits all of it, not only B's later blocks (which
    no prefix query reaches without the first ones)."""
    import random

    server = pega_server()
    rnd = random.Random(6)
    prefix = [rnd.randrange(50, 950) for _ in range(96)]  # 6 blocks
    longer = prefix + [rnd.randrange(50, 950) for _ in range(70)]  # 10 full
    a = Engine(vllm_config(tiny_model, FAST))
    serve(a, {"a": prefix})
    b = Engine(vllm_config(tiny_model, FAST))
    b.step()  # the worker tells the scheduler the query socket
    registrar = b.worker._worker.registrar

    def restart_before_the_load(so: object) -> None:
        if so.kv_connector_metadata.plan.loads:  # type: ignore[attr-defined]
            server.stop(signal.SIGKILL)
            pega_server()  # same port, empty pool
            # Registered again before the load and the recompute's saves,
            # as the background retry would be a step or two later.
            assert registrar.register_now()
            b.after_schedule = None

    b.after_schedule = restart_before_the_load
    serve(b, {"b": longer}, max_tokens=2)
    assert b.after_schedule is None and b.seen_waiting_remote == {"b"}
    assert b.counters()["load_failures"] == 1
    assert [p for p in b.seqs["b"].computed if p < len(prefix)] == list(
        range(len(prefix))
    )
    b.assert_clean()
    c = Engine(vllm_config(tiny_model, FAST))
    c.step()
    serve(c, {"c": longer})
    assert c.counters()["hit_tokens"] == len(longer) // BLOCK * BLOCK
    for engine in (a, b, c):
        engine.close()


def test_a_failed_sync_load_poisons_a_local_hit_on_its_blocks(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """B admits "a" and "b" in one step: "a" sync-loads A's prefix, and "b"
    hits those very blocks in vLLM's own prefix cache (cached as "a" was
    allocated). The load fails: "b" computed its tail over KV that never
    arrived. vLLM recomputes both; nothing of "b" is saved either, so C finds
    only what A saved."""
    import random

    pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096}
    rnd = random.Random(7)
    prefix = [rnd.randrange(50, 950) for _ in range(96)]  # 6 blocks
    first = prefix + [rnd.randrange(50, 950) for _ in range(70)]
    second = prefix + [rnd.randrange(50, 950) for _ in range(70)]
    a = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    serve(a, {"a": prefix})
    b = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    b.step()
    seen: dict[str, object] = {}

    def break_the_lease(so: object) -> None:
        plan = so.kv_connector_metadata.plan  # type: ignore[attr-defined]
        (job,) = plan.loads
        assert job.req_id == "a" and job.sync
        job.lease_id ^= 2  # unknown to the server: the item fails
        new = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        seen["local"] = new["b"]
        seen["saves"] = sorted(s.req_id for s in plan.saves)
        b.after_schedule = None

    b.after_schedule = break_the_lease
    b.add("a", first, max_tokens=2)
    b.add("b", second, max_tokens=2)
    b.run()
    assert b.errors == []
    assert seen == {"local": len(prefix), "saves": ["a", "b"]}
    assert b.counters()["load_failures"] == 1
    assert b.counters().get("save_blocks", 0) == 0
    b.assert_clean()
    c = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    c.step()
    serve(c, {"c": second})
    assert c.counters()["hit_tokens"] == len(prefix)
    for engine in (a, b, c):
        engine.close()


@pytest.mark.parametrize("chunk", [0, 32], ids=["recomputed", "chunked"])
def test_a_failed_sync_load_leaves_a_next_step_hit_its_saves(
    pega_server: Callable[..., ServerProc], tiny_model: Path, chunk: int
) -> None:
    """vLLM's ordinary scheduler (no async scheduling): "a"'s sync load of A's
    prefix fails, and vLLM hears of it before it schedules the next step, in
    which "a" recomputes the blocks and "c", admitted then, hits them in vLLM's
    prefix cache: it reads them as "a" writes them, in that forward; "d", a
    step later, reads them rewritten. Nothing of theirs was computed over the
    hole: their blocks are saved (every page checked, in B and as C loads
    them). Chunked ("a" recomputes 32 tokens a step): vLLM lets "c" read the 4
    blocks "a" has not rewritten yet (its recompute policy keeps them cached),
    and "d" the last 2; nothing of theirs is saved."""
    import random

    pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096}
    rnd = random.Random(8)
    prefix = [rnd.randrange(50, 950) for _ in range(96)]  # 6 blocks
    first, second, third = (
        prefix + [rnd.randrange(50, 950) for _ in range(70)] for _ in range(3)
    )  # 10 full blocks each
    a = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    serve(a, {"a": prefix})
    config = vllm_config(
        tiny_model, extra, async_scheduling=False, long_prefill_token_threshold=chunk
    )
    b = Engine(config)
    assert b.config.max_concurrent_batches == 1
    b.step()
    seen: list[tuple[dict, int]] = []

    def break_the_lease(so: Any) -> None:
        (job,) = so.kv_connector_metadata.plan.loads
        assert job.req_id == "a" and job.sync
        job.lease_id ^= 2  # unknown to the server: the item fails
        b.after_schedule = note_admissions

    def note_admissions(so: Any) -> None:
        new = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        seen.append((new, so.num_scheduled_tokens.get("a")))
        if len(seen) == 2:
            b.after_schedule = None

    b.after_schedule = break_the_lease
    b.add("a", first, max_tokens=2)
    b.step()  # the load fails; vLLM rewinds "a" to recompute it
    assert b.counters()["load_failures"] == 1
    b.add("c", second, max_tokens=2)
    b.step()
    b.add("d", third, max_tokens=2)
    b.run()
    hit = len(prefix)
    assert seen[0] == ({"c": hit}, chunk or len(first))
    assert seen[1][0] == {"d": hit}
    unread = {
        (rid, k)
        for rid, rewritten in (("c", chunk), ("d", 2 * chunk))
        for k in range(rewritten // BLOCK, hit // BLOCK if chunk else 0)
    }
    read = {e.split("forward: ")[1].split(" (id")[0] for e in b.errors}
    assert read == {f"{rid} block {k}" for rid, k in unread}
    # c's and d's 4 blocks past the prefix ("a"'s, computed after its
    # failure, are not saved)
    assert b.counters().get("save_blocks", 0) == (0 if chunk else 8)
    b.assert_clean()
    c = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    c.step()
    serve(c, {"c": second, "d": third}, max_tokens=2)
    # d hits the prefix in C's own prefix cache: the server gives its tail
    assert c.counters()["hit_tokens"] == (hit if chunk else 160 + 64)
    assert (c.outputs["c"], c.outputs["d"]) == (b.outputs["c"], b.outputs["d"])
    for engine in (a, b, c):
        engine.close()


@pytest.mark.parametrize("case", ["orphaned", "heard_late", "reused"])
def test_a_failed_sync_loads_blocks_its_aborted_owner_left_poison_their_readers(
    pega_server: Callable[..., ServerProc], tiny_model: Path, case: str
) -> None:
    """ "a"'s sync load of A's prefix fails and "a" is aborted before it
    recomputes (heard_late: before the failure was heard, as an abort may
    come between a step's schedule and its output under async scheduling):
    vLLM frees its blocks, hashes and all (its recompute policy never evicted
    them), and "c", admitted a step later, hits them in its prefix cache: it
    computes its tail over KV that never arrived, and saves none of it (C
    finds only A's prefix). Reused: "e" and "f" take every free block first,
    so vLLM gives the blocks out afresh (their hashes gone): "c" misses them,
    loads A's prefix and saves its tail (C hits it all)."""
    import random

    from vllm.v1.request import RequestStatus

    pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096}
    rnd = random.Random(9)
    prefix = [rnd.randrange(50, 950) for _ in range(96)]  # 6 blocks
    first, second = (prefix + [rnd.randrange(50, 950) for _ in range(70)] for _ in "ab")
    a = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    serve(a, {"a": prefix})
    config = vllm_config(
        tiny_model, extra, async_scheduling=False, max_num_batched_tokens=1024
    )
    b = Engine(config, num_blocks=40)
    b.step()
    aborted = RequestStatus.FINISHED_ABORTED

    def break_the_lease(so: Any) -> None:
        (job,) = so.kv_connector_metadata.plan.loads
        assert job.req_id == "a" and job.sync
        job.lease_id ^= 2  # unknown to the server: the item fails
        holes.update(b.table("a")[:10])  # loaded, or computed over the load
        b.after_schedule = None
        if case == "heard_late":
            b.sched.finish_requests("a", aborted)

    holes: set[int] = set()
    b.after_schedule = break_the_lease
    b.add("a", first, max_tokens=2)
    b.step()  # the load fails; vLLM rewinds "a" to recompute it
    assert b.counters()["load_failures"] == 1
    b.sched.finish_requests("a", aborted)
    b.run()  # vLLM and both halves hear of it: "c" comes a step after
    reallocated = case == "reused"
    if reallocated:  # all 39 blocks in one step: the free queue's, then a's
        serve(b, {"e": [7] * 300, "f": [8] * 316}, max_tokens=1)
    assert admitted_hit(b, "c", second) == len(prefix)
    # what "c" read, and kept (never rewritten: checked as it finished)
    read = {e.split(" (id")[0].split(": ")[-1] for e in b.errors}
    assert read == (set() if reallocated else {f"c block {k}" for k in range(6)})
    b.assert_clean()
    c = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    c.step()
    serve(c, {"c": second}, max_tokens=2)
    assert c.counters()["hit_tokens"] == (160 if reallocated else len(prefix))
    assert c.outputs["c"] == b.outputs["c"]
    # still cached and unwritten, or given out afresh
    orphans = b.scheduler_connector._scheduler._orphans
    assert orphans == ({} if reallocated else {0: holes})
    for engine in (a, b, c):
        engine.close()


def test_blocks_computed_over_a_failed_sync_load_are_holes_too(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """ "a" computes its tail over its sync load in the step the load fails;
    vLLM caches those blocks too. "a" recomputes 96 tokens a step (the
    prefix) and is aborted: its tail, computed over the hole, stays cached,
    and "c", admitted a step later, hits all 10 blocks of "a": it saves
    nothing ("x" fills no block; "a" saves nothing after its failure): its
    tail, saved, would be found once another engine saved blocks 6-9."""
    import random

    from vllm.v1.request import RequestStatus

    pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096}
    rnd = random.Random(10)
    prefix = [rnd.randrange(50, 950) for _ in range(96)]  # 6 blocks
    first = prefix + [rnd.randrange(50, 950) for _ in range(70)]  # 10 blocks
    second = first[:160] + [rnd.randrange(50, 950) for _ in range(50)]
    a = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    serve(a, {"a": prefix})
    config = vllm_config(
        tiny_model, extra, async_scheduling=False, long_prefill_token_threshold=96
    )
    b = Engine(config)
    b.step()

    def break_the_lease(so: Any) -> None:
        (job,) = so.kv_connector_metadata.plan.loads
        job.lease_id ^= 2  # unknown to the server: the item fails
        b.after_schedule = None

    b.after_schedule = break_the_lease
    b.add("a", first, max_tokens=2)
    b.step()  # the load fails; vLLM rewinds "a" to recompute it
    b.add("x", [5] * 10, max_tokens=2)  # not alone: vLLM chunks "a"
    assert b.step()["scheduled"] == {"a": 96, "x": 10}  # a's blocks 0-5 rewritten
    b.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    b.run()
    # all of "a"'s blocks, in vLLM's prefix cache
    assert admitted_hit(b, "c", second) == 160
    assert b.errors == []  # the fake forward writes what "a" would have
    assert b.counters().get("save_blocks", 0) == 0
    b.assert_clean()
    a.close()
    b.close()


def admitted_hit(b: Any, rid: str, prompt: list[int]) -> int:
    """Add `rid` and run: the tokens vLLM counted computed as it admitted it
    (a local hit, or a prefix loaded)."""
    hits: dict[str, int] = {}

    def note_hit(so: Any) -> None:
        hits.update({r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs})

    b.after_schedule = note_hit
    b.add(rid, prompt, max_tokens=2)
    b.run()
    return hits[rid]
