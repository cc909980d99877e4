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


def engine(model: Path, extra: dict | None = None, **kw: Any) -> OverlappedEngine:
    sched = {k: kw.pop(k) for k in list(kw) if k in ("max_num_batched_tokens",)}
    return OverlappedEngine(vllm_config(model, extra or FAST, **sched), **kw)


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


@pytest.mark.parametrize("sync", [False, True], ids=["async_load", "sync_load"])
def test_engine_b_hits_what_engine_a_saved(
    pega_server: Callable[..., ServerProc], tiny_model: Path, sync: bool
) -> None:
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
    b.step()  # the worker tells the scheduler the query socket
    b.run()
    serve(b, batch, max_tokens=20)
    counters = b.counters()
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert counters["load_blocks"] * BLOCK == counters["hit_tokens"]
    assert counters["load_failures"] == 0
    assert (b.seen_waiting_remote == set(batch)) is not sync
    for rid, tokens in batch.items():  # only what was not loaded
        computed = [p for p in b.seqs[rid].computed if p < len(tokens)]
        assert len(computed) == len(tokens) - hit_tokens(tokens, len(tokens))
    assert a.outputs == b.outputs == control(tiny_model, batch, max_tokens=20)
    b.assert_clean()
    assert server.metric("pegaflow_active_leases") == 0
    a.close()
    b.close()
