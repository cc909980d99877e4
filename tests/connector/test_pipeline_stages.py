"""Pipeline parallelism through vLLM 0.33's real Scheduler: each stage's
WORKER-role connector registers, saves and loads its own layers (a part of its
own on the real server); a hit needs every stage's part, and every page a
stage loads is checked before its forward reads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.connector.conftest import needs_vllm
from tests.procs import ServerProc

needs_vllm()

from tests.connector.engine import BLOCK, Engine, vllm_config  # noqa: E402
from tests.connector.test_hybrid_groups import (  # noqa: E402
    prompts,
    serve,
    serve_hitting,
    sliding_specs,
)

FAST = {"retry_interval_s": 0.2}


def engine(model: Path, hybrid: bool = False) -> Engine:
    config = vllm_config(model, {**FAST, "sync_load_max_tokens": 4096})
    specs = sliding_specs() if hybrid else None
    return Engine(config, specs=specs, stages=2)


def test_two_stages_hit_what_two_stages_saved(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    server = pega_server()
    batch = prompts(21)
    a = engine(tiny_model)
    serve(a, batch)
    a.assert_clean()
    assert a.counters()["save_blocks"] > 0

    b = engine(tiny_model)
    loads = serve_hitting(b, batch)
    for rid, tokens in batch.items():
        hit = (len(tokens) - 1) // BLOCK
        stages = {job.stage: len(job.block_ids) for job in loads[rid]}
        assert stages == {0: hit, 1: hit}
        # Asked for sync loads, it loads between steps: a sync load failing
        # on one stage would leave the other's KV (and saves) computed over
        # the hole without its knowing.
        assert not any(job.sync for job in loads[rid])
    _, body = server.get("/stats")
    assert len(json.loads(body)["namespaces"]) == 2  # one per stage's layers
    a.close()
    b.close()


def test_a_hybrid_model_over_two_stages(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """Stage 0 holds two window layers, stage 1 a window and the full layer:
    each stage registers only the groups it has layers of."""
    pega_server()
    batch = prompts(22)
    a = engine(tiny_model, hybrid=True)
    serve(a, batch)
    b = engine(tiny_model, hybrid=True)
    loads = serve_hitting(b, batch)
    parts = {(job.stage, job.group) for jobs in loads.values() for job in jobs}
    assert parts == {(0, 0), (0, 1), (1, 2), (1, 3)}
    a.close()
    b.close()


def test_a_block_one_stage_never_saved_is_no_hit(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """Stage 1 of engine A cannot reach the server: stage 0's blocks alone
    are no hit for B (a block counts once every stage has landed it)."""
    pega_server()
    batch = prompts(23, n=2)
    a = engine(tiny_model)
    a.workers[1]._worker.registrar.close()  # its saves are skipped from now on
    a.workers[1]._worker.registrar._next_try = float("inf")
    serve(a, batch)
    assert a.counters()["saves_skipped"] > 0
    b = engine(tiny_model)
    b.step()
    serve(b, batch)
    b.assert_clean()
    counters = b.counters()
    assert counters["queries"] > 0
    assert counters.get("hit_tokens", 0) == 0
    for rid in batch:
        assert min(b.seqs[rid].computed) == 0
    a.close()
    b.close()
