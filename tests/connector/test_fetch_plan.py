"""Fetch or recompute (connector/fetch_plan.py): the planner's arithmetic, and
engines with the real scheduler deciding against a real server's SSD tier:
a fast model recomputes what the SSD would bring in later than it computes
it; a slow one waits for the SSD and loads (byte-checked), and loads L1 hits.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from connector.fetch_plan import FetchPlanner, clamp_gbps
from tests.connector.conftest import needs_vllm
from tests.procs import ServerProc

MiB = 1 << 20


def test_rates_are_clamped_and_nonsense_is_unknown() -> None:
    assert clamp_gbps(float("nan")) == clamp_gbps(-1.0) == clamp_gbps(0.0) == 0.0
    assert clamp_gbps(float("inf")) == 0.0
    assert clamp_gbps(1e9) == 1e4 and clamp_gbps(1e-9) == 1e-3


def test_without_a_prefill_rate_or_a_tier_rate_every_hit_loads() -> None:
    p = FetchPlanner()
    assert p.ready(10, MiB, 16, 5.0).decision == "load"  # no prefill timed yet
    p.observe_prefill(16_000, 0.001)  # a very fast model
    assert p.pulling("r", 0.0, 10, MiB, 16, 0.0, 5.0).decision == "load"
    assert p.ready(10, MiB, 16, float("nan")).decision == "load"
    off = FetchPlanner(enabled=False)
    off.observe_prefill(16_000, 0.001)
    assert off.ready(10, MiB, 16, 0.001).decision == "load"


def test_l1_loads_when_it_beats_the_prefill_and_not_otherwise() -> None:
    p = FetchPlanner()
    p.observe_prefill(1000, 1.0)  # 1,000 tokens/s: 16 tokens take 16 ms
    est = p.ready(4, MiB, 16, 10.0)  # 4 MiB at 10 GB/s: 0.4 ms
    assert est.decision == "load" and est.load_s < est.compute_s
    assert p.ready(4, MiB, 16, 0.01).decision == "recompute"  # 0.4 s > 64 ms


def test_a_pull_is_waited_for_only_while_it_pays() -> None:
    p = FetchPlanner()
    p.observe_prefill(1000, 1.0)
    # 8 blocks: 128 ms to compute; 8 MiB at 1 GB/s + L1: ~9 ms to load.
    assert p.pulling("r", 100.0, 8, MiB, 16, 1.0, 10.0).decision == "load"
    # Still pulling at twice the prediction: computing is sooner from now.
    assert p.pulling("r", 100.01, 8, MiB, 16, 1.0, 10.0).decision == "load"
    gave_up = p.pulling("r", 100.02, 8, MiB, 16, 1.0, 10.0)
    assert gave_up.decision == "recompute" and gave_up.load_s < gave_up.compute_s
    p.forget("r")  # a new wait starts afresh
    assert p.pulling("r", 200.0, 8, MiB, 16, 1.0, 10.0).decision == "load"
    # A tier slower than computing: recompute at once.
    assert p.pulling("s", 0.0, 8, MiB, 16, 0.01, 10.0).decision == "recompute"


def _flags(ssd: Path) -> list[str]:
    flags = ["--ssd-cache-path", str(ssd), "--ssd-cache-capacity", "64mb"]
    return flags + ["--ssd-backend", "posix", "--ssd-write-on", "seal"]


def test_engines_recompute_a_slow_pull_and_load_a_fast_one(
    pega_server: Callable[..., ServerProc], tiny_model: Path, tmp_path: Path
) -> None:
    """Scenario: A saves three batches, on the SSD too; the server restarts
    with an empty pool, so they are on the SSD only. A fast engine (a forward
    that costs nothing) loads the first batch, one prompt, from the SSD (no
    rates known while it waits), after which the server knows the SSD's
    rate: it recomputes the second instead of waiting for it. A slow engine
    (2 ms per token) waits for the third batch's pull and loads it
    byte-equal, and loads the second from L1 (the fast engine's declined pull
    still landed there)."""
    needs_vllm()
    from tests.connector.engine import Engine, vllm_config
    from tests.connector.test_restart import _written
    from tests.connector.test_two_engines import FAST, hit_tokens, prompts, serve

    flags = _flags(tmp_path / "ssd.bin")
    # The first batch is one prompt: a planner re-asks while a pull runs, so a
    # second prompt still pulling after the first one's load would be weighed
    # with both rates known by then (and recomputed by this free forward).
    batches = [prompts(40 + i, n=1 if i == 0 else 2) for i in range(3)]
    server = pega_server(*flags)
    a = Engine(vllm_config(tiny_model, FAST))
    for batch in batches:
        serve(a, batch)
    a.assert_clean()
    saved = int(a.counters()["save_blocks"])
    a.close()
    _written(server, saved)
    server.stop(signal.SIGKILL)
    server = pega_server(*flags)
    assert server.metric("pegaflow_ssd_blocks") == saved

    def hits(batch: dict[str, list[int]]) -> int:
        return sum(hit_tokens(t, len(t)) for t in batch.values())

    warm = {"warm-fast": list(range(300, 500))}  # a miss: 200 tokens timed
    fast = Engine(vllm_config(tiny_model, FAST), write_kv=False)
    fast.step()  # an idle step: the worker tells the scheduler the query socket
    serve(fast, warm)
    serve(fast, batches[0])
    assert fast.counters()["hit_tokens"] == hits(batches[0])  # rates unknown: load
    time.sleep(0.6)  # the next forward timings ride a report
    serve(fast, {"warm-fast-2": list(range(500, 700))})
    assert fast.planner_rate() > 0
    before = fast.counters()
    serve(fast, batches[1])
    after = fast.counters()
    assert after["hit_tokens"] == before["hit_tokens"]  # nothing loaded
    declined = "planner_recomputed_tokens"
    assert after[declined] - before[declined] >= hits(batches[1])
    fast.close()

    slow = Engine(vllm_config(tiny_model, FAST), forward_s_per_token=0.002)
    slow.step()
    serve(slow, {"warm-slow": list(range(700, 800))})
    assert slow.planner_rate() > 0
    serve(slow, batches[2])  # from the SSD: waited for, then loaded
    serve(slow, batches[1])  # from L1
    slow.assert_clean()  # every loaded page byte-checked
    counters = slow.counters()
    assert counters["hit_tokens"] == hits(batches[2]) + hits(batches[1])
    assert counters["planner_recomputed_tokens"] == 0
    assert counters["load_failures"] == 0
    slow.close()


def test_a_pull_is_never_waited_for_longer_than_the_bound() -> None:
    """With no rate to price it (none from the server, no prefill timed yet,
    the planner off), a request waited for a pull as long as the server said
    `loading`: for good, if it always did. Now at most max_wait_s."""
    for planner in (FetchPlanner(max_wait_s=5.0), FetchPlanner(False, 5.0)):
        assert planner.pulling("r", 100.0, 8, MiB, 16, 0.0, 0.0).decision == "load"
        assert planner.pulling("r", 104.9, 8, MiB, 16, 0.0, 0.0).decision == "load"
        assert planner.pulling("r", 105.0, 8, MiB, 16, 0.0, 0.0).decision == "recompute"
