"""Two vLLM engines (real Scheduler, real KV views) and one real server: engine A
computes and saves, engine B gets hits and its loaded pages equal A's bytes."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.connector.conftest import needs_vllm
from tests.procs import ServerProc

needs_vllm()

from tests.connector.engine import BLOCK, Engine, vllm_config  # noqa: E402

FAST = {"retry_interval_s": 0.2}
# Sync loads need vLLM's ordinary scheduler: with async scheduling (a step
# scheduled before the last one's output) the connector loads between steps.
IN_TURN = {"async_scheduling": False}


def prompts(seed: int, n: int = 3, base: int = 100) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    return {
        f"r{seed}-{i}": [rnd.randrange(50, 950) for _ in range(base + 17 * i)]
        for i in range(n)
    }


def serve(engine: Engine, batch: dict[str, list[int]], max_tokens: int = 4) -> dict:
    for rid, tokens in batch.items():
        engine.add(rid, tokens, max_tokens)
    finished = engine.run()
    assert engine.errors == []
    return finished


def hit_tokens(tokens: list[int], cached: int) -> int:
    """What B may load: whole blocks, never the last token."""
    return min(cached, (len(tokens) - 1) // BLOCK) * BLOCK


@pytest.mark.parametrize(
    ("layout_a", "layout_b", "sync"),
    [("LBNHC", "LBNHC", False), ("BLNHC", "LBNHC", True), ("LBHNC", "BLHNC", False)],
)
def test_engine_b_hits_what_engine_a_saved(
    pega_server: Callable[..., ServerProc],
    tiny_model: Path,
    layout_a: str,
    layout_b: str,
    sync: bool,
) -> None:
    server = pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096 if sync else 0}
    batch = prompts(1)
    a = Engine(vllm_config(tiny_model, extra, **(IN_TURN if sync else {})), layout_a)
    serve(a, batch)
    a.assert_clean()
    assert a.counters()["save_blocks"] == sum(
        (len(t) + 3) // BLOCK for t in batch.values()
    )

    b = Engine(vllm_config(tiny_model, extra, **(IN_TURN if sync else {})), layout_b)
    b.step()  # an idle step: the worker tells the scheduler the query socket
    loads_per_step: list[int] = []
    b.after_schedule = lambda so: loads_per_step.append(
        len(so.kv_connector_metadata.plan.loads)
    )
    first_step: dict[str, int] = {}
    for rid, tokens in batch.items():
        b.add(rid, tokens, max_tokens=4)
    while b.sched.has_unfinished_requests() or b.sched.has_finished_requests():
        result = b.step()
        for rid, n in result["scheduled"].items():
            first_step.setdefault(rid, n)
    assert b.errors == []
    for rid, tokens in batch.items():
        hit = hit_tokens(tokens, len(tokens))
        prompt_computed = [p for p in b.seqs[rid].computed if p < len(tokens)]
        assert len(prompt_computed) == len(tokens) - hit, rid
        assert first_step[rid] == len(tokens) - hit  # only the remainder
    assert (b.seen_waiting_remote == set(batch)) is not sync
    assert not (b.seen_waiting_remote and sync)
    counters = b.counters()
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert (
        counters["load_bytes"]
        == counters["load_blocks"] * a.worker._worker.registrar.slot_bytes
    )
    assert counters["load_failures"] == 0
    # Sync loads: the forward waited layer by layer on the server's signals
    # (b.errors above: every layer's pages were right when its wait returned).
    assert (counters["layerwise_loads"] > 0) is sync
    # One Load per step for every request's lease (all sync or all async here).
    assert max(loads_per_step) == len(batch)
    assert server.metric(
        "pegaflow_rpc_seconds_count",
        'code="OK",method="Load"',  # a label prefix: both transports
    ) == sum(1 for n in loads_per_step if n)
    b.assert_clean()
    assert server.metric("pegaflow_active_leases") == 0
    # The workers passed the socket on: B's queries skipped gRPC.
    unix = server.metric(
        "pegaflow_rpc_seconds_count",
        'code="OK",method="QueryPrefix",transport="unix"',
    )
    assert unix >= len(batch)
    a.close()
    b.close()


def test_layouts_with_other_page_bytes_do_not_share(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """LBNHC and LBHNC pages order heads and tokens differently: two namespaces."""
    pega_server()
    batch = prompts(2, n=1)
    a = Engine(vllm_config(tiny_model, FAST), "LBNHC")
    serve(a, batch)
    b = Engine(vllm_config(tiny_model, FAST), "LBHNC")
    serve(b, {f"{rid}-b": t for rid, t in batch.items()})
    assert b.counters()["hit_tokens"] == 0
    assert a.worker._worker.registrar.namespace != b.worker._worker.registrar.namespace
    a.close()
    b.close()


def test_partial_prefix_and_decode_time_saves(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """B's prompts share only a prefix with A's (hits stop at the first new
    block); a B prompt extending A's prompt + outputs hits blocks A filled
    while decoding."""
    pega_server()
    rnd = random.Random(3)
    shared = [rnd.randrange(50, 950) for _ in range(64)]
    a = Engine(vllm_config(tiny_model, FAST))
    serve(a, {"long": shared + [7] * 40}, max_tokens=40)  # 104 + 40 tokens
    generated = a.outputs["long"]
    assert len(generated) == 40

    b = Engine(vllm_config(tiny_model, FAST))
    serve(
        b,
        {
            "diverge": shared + [9] * 40,  # 4 shared blocks, then new tokens
            "extend": shared + [7] * 40 + generated + [11] * 5,
        },
    )
    prompt_of = {"diverge": 104, "extend": 104 + 40 + 5}
    computed = {
        rid: len([p for p in b.seqs[rid].computed if p < prompt_of[rid]])
        for rid in prompt_of
    }
    assert computed["diverge"] == 104 - 64
    # A's KV covers tokens [0, 143): 8 full blocks, 3 of them filled in decode.
    assert computed["extend"] == prompt_of["extend"] - 8 * BLOCK
    b.assert_clean()
    a.close()
    b.close()


def test_preemption_keeps_bytes_right_and_leaks_nothing(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """A pool too small for every request's decode: vLLM preempts and resumes
    requests; saves of preempted requests finish before their blocks are reused."""
    pega_server()
    config = vllm_config(tiny_model, FAST, max_len=256)
    a = Engine(config, num_blocks=24)
    batch = prompts(4, n=4, base=60)
    preempted: set[str] = set()
    for rid, tokens in batch.items():
        a.add(rid, tokens, max_tokens=60)
    while a.sched.has_unfinished_requests() or a.sched.has_finished_requests():
        a.step()
        preempted |= {r.request_id for r in a.sched.waiting if r.num_preemptions}
    assert preempted, "the scenario must preempt"
    assert a.errors == []
    a.assert_clean()
    b = Engine(vllm_config(tiny_model, FAST, max_len=256), num_blocks=24)
    serve(b, batch, max_tokens=2)
    assert b.counters()["hit_tokens"] > 0
    b.assert_clean()
    a.close()
    b.close()


def test_full_cuda_graph_step_waits_for_the_whole_sync_load(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """Scenario: vLLM's V1 runner replays a FULL CUDA graph (a hit covering all
    but the last token leaves a one-token, decode-like step). The replay calls
    no wait_for_layer_load, yet the load went layer-wise: the forward read
    layers the server had not written yet. Now start_load_kv waits for the
    whole load first (the harness checks the pages when it returns)."""
    pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096}
    batch = prompts(13)
    a = Engine(vllm_config(tiny_model, extra, **IN_TURN))
    serve(a, batch)
    b = Engine(vllm_config(tiny_model, extra, **IN_TURN), full_cuda_graph=True)
    b.step()  # an idle step: the worker tells the scheduler the query socket
    serve(b, batch)  # pages checked when start_load_kv returned and at the end
    counters = b.counters()
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert counters["layerwise_loads"] == 0 and counters["load_failures"] == 0
    b.assert_clean()
    a.close()
    b.close()


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_speculative_decoding_order_saves_and_loads(
    pega_server: Callable[..., ServerProc], tiny_model: Path, sync: bool
) -> None:
    """vLLM's call order with speculative decoding (transfer results before
    wait_for_save) end to end: A saves prompt and decode blocks, B loads them
    with pages right, and nothing is left held or in flight."""
    server = pega_server()
    extra = {**FAST, "sync_load_max_tokens": 4096 if sync else 0}
    batch = prompts(14)
    a = Engine(
        vllm_config(tiny_model, extra, **(IN_TURN if sync else {})),
        spec_decode_order=True,
    )
    serve(a, batch, max_tokens=20)
    a.assert_clean()
    assert a.counters()["save_blocks"] == sum(
        (len(t) + 19) // BLOCK for t in batch.values()
    )
    b = Engine(
        vllm_config(tiny_model, extra, **(IN_TURN if sync else {})),
        spec_decode_order=True,
    )
    b.step()
    serve(b, batch)
    counters = b.counters()
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert counters["load_failures"] == 0
    b.assert_clean()
    assert server.metric("pegaflow_active_leases") == 0
    a.close()
    b.close()


def test_a_closed_engine_leaves_its_kv_memory_free_for_the_next(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """Its memfd's pages count as in use while a SharedMemory handed out for
    them lives (pegaflow.client.host_share): held past shutdown, a later
    engine of the process whose KV lands on those pages could not share
    them, and its server copies fell back to process_vm. Closed, A holds
    none of its handouts, with no collection of reference cycles needed.

    Asked of A's own handouts, not of their memfds: A's KV may land on pages
    an earlier engine of this process left mapped from a memfd of its own,
    and A is then handed that memfd again; that engine's handout, not A's,
    may keep it in use (one not closed lives until a collection)."""
    import gc
    import weakref

    pega_server()
    gc.disable()  # only what is no longer referenced goes
    try:
        a = Engine(vllm_config(tiny_model, FAST))
        serve(a, prompts(27, n=1))
        halves = [w._worker for w in a.workers]
        handouts = {p._shared for h in halves for p in h.parts.values()} - {None}
        assert handouts  # the server mapped A's KV
        alive = [weakref.ref(s) for s in handouts]
        del handouts
        a.close()
        assert all(r() is None for r in alive), "a closed engine holds its memfd"
    finally:
        gc.enable()
