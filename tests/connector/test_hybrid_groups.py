"""Hybrid models through vLLM 0.33's real Scheduler with its hybrid KV manager
on: sliding-window + full-attention groups (each its own block table, null
blocks where the window moved on) against one real server. Engine A computes
and saves; engine B hits, and every page it loads, in every group, is checked
byte by byte before its forward reads it (Engine.restored_errors)."""

from __future__ import annotations

import json
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.connector.conftest import needs_vllm
from tests.procs import ServerProc

needs_vllm()

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from pegaflow.connector.kv_groups import groups_of  # noqa: E402
from tests.connector.engine import BLOCK, HEAD, Engine, vllm_config  # noqa: E402

WINDOW = 32  # tokens: a hit needs the last cdiv(31, 16) = 2 blocks of the window
FAST = {"retry_interval_s": 0.2}


def _attn(cls: type, **extra: object) -> object:
    return cls(
        block_size=BLOCK,
        num_kv_heads=2,
        head_size=HEAD,
        dtype=torch.bfloat16,
        **extra,
    )


def sliding_specs(layers: int = 4) -> dict[str, object]:
    """Every fourth layer full attention, the others a sliding window (as
    Gemma 3's pattern, shorter)."""
    full = _attn(FullAttentionSpec)
    window = _attn(SlidingWindowSpec, sliding_window=WINDOW)
    return {
        f"model.layers.{i}.self_attn.attn": full if i % 4 == 3 else window
        for i in range(layers)
    }


def engine(model: Path, **kw: object) -> Engine:
    # A sync load of a hybrid model could not fail safely: every load is
    # async, whatever sync_load_max_tokens says.
    extra = {**FAST, "sync_load_max_tokens": 4096}
    return Engine(vllm_config(model, extra), specs=sliding_specs(), **kw)


def prompts(seed: int, n: int = 3, base: int = 100) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    return {
        f"h{seed}-{i}": [rnd.randrange(50, 950) for _ in range(base + 23 * i)]
        for i in range(n)
    }


def serve(e: Engine, batch: dict[str, list[int]], max_tokens: int = 4) -> None:
    for rid, tokens in batch.items():
        e.add(rid, tokens, max_tokens)
    e.run()
    assert e.errors == [], (e.errors, memory_report(e))


def memory_report(e: Engine) -> str:
    """Where each worker's KV lies and what maps it now: a wrong page after a
    load through the shared memfd points at a mapping that moved (a CI run of
    test_pipeline_stages once had every stage-0 page wrong, stage 1 right)."""
    from pegaflow.client import host_share

    lines = []
    for s, w in enumerate(e.workers):
        for g, part in w._worker.parts.items():
            shared = part._shared
            spans = (
                None
                if shared is None
                else [(hex(x.address), x.size, x.offset) for x in shared.spans]
            )
            lines.append(
                f"stage {s} group {g}: regions "
                f"{[(hex(a), n) for a, n in part._host_regions]} "
                f"memfd spans {spans} signals "
                f"{hex(part.layer_signals.ctypes.data)}"
            )
    known = [
        [(hex(x.address), x.size) for x in k.spans]
        for _, live in host_share._held.values()
        for k in list(live)
    ]
    lines.append(f"registry: {known}")
    lo = min(
        (
            a
            for w in e.workers
            for p in w._worker.parts.values()
            for a, _ in p._host_regions
        ),
        default=0,
    )
    with open("/proc/self/maps") as maps:
        near = [
            ln.strip() for ln in maps if abs(int(ln.split("-")[0], 16) - lo) < 1 << 26
        ]
    return "\n".join(lines + near[:40])


def serve_hitting(b: Engine, batch: dict[str, list[int]]) -> dict[str, list]:
    """B serves prompts another engine saved: each hits every full block but
    the last token's, and B computes only past it. Its load jobs by request."""
    b.step()  # an idle step: the workers report (the query socket, stages)
    loads: list = []
    b.after_schedule = lambda so: loads.extend(so.kv_connector_metadata.plan.loads)
    serve(b, batch)
    b.assert_clean()
    by_request: dict[str, list] = {}
    for rid, tokens in batch.items():
        hit = (len(tokens) - 1) // BLOCK
        prompt = [p for p in b.seqs[rid].computed if p < len(tokens)]
        assert min(prompt) == hit * BLOCK, rid  # B computed only past the hit
        by_request[rid] = [job for job in loads if job.req_id == rid]
    return by_request


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_sliding_window_hybrid_hits_every_group_byte_equal(
    pega_server: Callable[..., ServerProc], tiny_model: Path, layout: str
) -> None:
    server = pega_server()
    batch = prompts(3)
    a = engine(tiny_model, layout=layout)
    assert len(a.kv_cache_config.kv_cache_groups) == 4  # 3 windows + 1 full
    serve(a, batch)
    a.assert_clean()

    b = engine(tiny_model, layout=layout)
    loads = serve_hitting(b, batch)
    for rid, tokens in batch.items():
        hit = (len(tokens) - 1) // BLOCK
        mine = loads[rid]
        by_group = {job.group: len(job.block_ids) for job in mine}
        # The full group loads the prefix; each window group only the two
        # blocks its window needs at the hit (vLLM's null blocks below).
        assert by_group == {0: 2, 1: 2, 2: 2, 3: hit}, (rid, by_group)
        assert not any(job.sync for job in mine)
    assert b.seen_waiting_remote == set(batch)
    counters = b.counters()
    assert counters["load_failures"] == 0
    assert counters["hit_tokens"] == sum(
        (len(t) - 1) // BLOCK * BLOCK for t in batch.values()
    )
    _, body = server.get("/stats")
    namespaces = json.loads(body)["namespaces"]
    assert len(namespaces) == 4, namespaces  # one per group: their pages differ
    a.close()
    b.close()


def test_an_early_shared_prefix_hits_after_the_window_moved_on(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """vLLM's own prefix cache frees a window's blocks once it moves on; the
    server keeps every block as it filled, so a prompt sharing only an early
    prefix with an old one still hits that prefix."""
    pega_server()
    rnd = random.Random(11)
    shared = [rnd.randrange(50, 950) for _ in range(6 * BLOCK)]
    old = shared + [rnd.randrange(50, 950) for _ in range(20 * BLOCK)]
    new = shared + [rnd.randrange(50, 950) for _ in range(3 * BLOCK)]
    a = engine(tiny_model)
    serve(a, {"old": old})
    # The same engine: its own prefix cache had the blocks too.
    hits: dict[str, int] = {}
    a.after_schedule = lambda so: hits.update(
        {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    )
    serve(a, {"new": new})
    a.assert_clean()
    assert hits["new"] == len(shared), hits  # local + ours: the whole prefix
    assert a.counters()["hit_tokens"] > 0  # ... and the server served it
    a.close()


def test_a_group_whose_load_fails_fails_the_request_in_every_group(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """One group's lease gone before its load: every block of the request's
    hit, in every group, is a load error (vLLM recomputes), never a partial
    restore."""
    pega_server()
    batch = prompts(5, n=1, base=120)
    a = engine(tiny_model)
    serve(a, batch)

    b = engine(tiny_model)
    b.step()
    from pegaflow.client.pegaflow_client import PegaflowClient

    client = PegaflowClient(b.worker._worker.config.addr)
    planned: list[object] = []

    def drop_one_lease(so: object) -> None:
        jobs = so.kv_connector_metadata.plan.loads
        if jobs and not planned:
            planned.extend(jobs)
            client.release_lease(next(j for j in jobs if j.group == 1).lease_id)

    results: list[object] = []
    take = b.worker.get_transfer_results
    b.worker.get_transfer_results = lambda ids: (
        results.append(take(ids)) or (results[-1])
    )
    admitted: list[int] = []
    b.after_schedule = lambda so: (
        drop_one_lease(so),
        admitted.extend(n.num_computed_tokens for n in so.scheduled_new_reqs),
    )
    serve(b, batch)
    b.assert_clean()
    client.close()
    (rid,) = batch
    assert len({job.group for job in planned}) == 4
    assert [r.failed_recving for r in results if r.failed_recving] == [{rid}]
    # vLLM dropped the failed load and asked again: a request whose load
    # failed is a miss from then on (a hit claimed again could fail the same
    # way forever), so it is recomputed from the start, its pages checked.
    hit = (len(batch[rid]) - 1) // BLOCK * BLOCK
    assert admitted == [0]
    assert min(b.seqs[rid].computed) == 0
    counters = b.counters()
    assert counters["load_failures"] == 1
    assert counters["hit_tokens"] == hit
    b.close()


def mamba_specs(layers: int = 4) -> dict[str, object]:
    """Every fourth layer full attention, the others Mamba (align mode), as
    Qwen3-Next's pattern; the state page as large as an attention page."""
    full = _attn(FullAttentionSpec)
    state = MambaSpec(
        block_size=BLOCK,
        shapes=((full.page_size_bytes // 4,),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
    )
    return {
        f"model.layers.{i}.self_attn.attn"
        if i % 4 == 3
        else f"model.layers.{i}.mixer": (full if i % 4 == 3 else state)
        for i in range(layers)
    }


def mamba_engine(model: Path) -> Engine:
    config = vllm_config(model, FAST)
    config.cache_config.mamba_cache_mode = "align"
    return Engine(config, specs=mamba_specs())


def test_mamba_hybrid_restores_the_state_at_the_hit_boundary(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """A hit needs the full group's prefix and each Mamba group's state at
    the hit's boundary (one block); B's first step starts from the loaded
    state, checked as it reads it."""
    pega_server()
    batch = prompts(7)
    a = mamba_engine(tiny_model)
    assert a.sched.need_mamba_block_aligned_split
    serve(a, batch)
    a.assert_clean()

    b = mamba_engine(tiny_model)
    loads = serve_hitting(b, batch)
    for rid, tokens in batch.items():
        hit = (len(tokens) - 1) // BLOCK
        mine = {job.group: job for job in loads[rid]}
        assert {g: len(j.block_ids) for g, j in mine.items()} == {
            0: 1,
            1: 1,
            2: 1,
            3: hit,
        }
    # A longer prompt sharing one of them: the state where that one's
    # prefill stopped is the hit.
    rid, tokens = next(iter(batch.items()))
    longer = {"longer": tokens + [5] * (3 * BLOCK)}
    c = mamba_engine(tiny_model)
    c.step()
    admitted: list[int] = []
    c.after_schedule = lambda so: admitted.extend(
        n.num_computed_tokens for n in so.scheduled_new_reqs
    )
    serve(c, longer)
    assert admitted == [(len(tokens) - 1) // BLOCK * BLOCK]
    for e in (a, b, c):
        e.close()


def _config(*groups: KVCacheGroupSpec) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=list(groups), hash_block_size=None)


def test_a_group_we_cannot_restore_is_refused_naming_spec_and_layers() -> None:
    cross = KVCacheGroupSpec(
        ["model.decoder.layers.0.encoder_attn"], _attn(CrossAttentionSpec)
    )
    full = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], _attn(FullAttentionSpec))
    with pytest.raises(ValueError, match="CrossAttentionSpec.*encoder_attn"):
        groups_of(_config(full, cross), BLOCK)
    state = MambaSpec(
        block_size=BLOCK,
        shapes=((4, 8),),
        dtypes=(torch.float32,),
        mamba_cache_mode="all",
    )
    mamba = KVCacheGroupSpec(["model.layers.1.mixer"], state)
    with pytest.raises(ValueError, match="mamba_cache_mode='align'.*|'all'"):
        groups_of(_config(full, mamba), BLOCK)
    rules = groups_of(_config(full), BLOCK).rules
    assert [(r.kind, r.layer_names) for r in rules] == [
        ("full", ("model.layers.0.self_attn.attn",))
    ]


def test_a_block_the_v2_runner_zeroes_is_never_read_by_a_save_in_flight(
    pega_server: Callable[..., ServerProc],
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.33's V2 model runner zeroes the blocks a step allocates (a Mamba
    model's KV needs it) before the connector's handle_preemptions. Here the
    first step's Save stalls (the server stopped) and the next step preempts
    two requests and hands one of their saved blocks to another, zeroed: the
    Save must have read it before (wait_for_save waits for it), never storing
    zeros under the block's hash. B then loads every prompt, checked byte by
    byte (the attention pages, and each Mamba state as a step reads it)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    server = pega_server()

    def v2_engine(**kw: object) -> Engine:
        config = vllm_config(tiny_model, FAST, max_len=128)
        config.cache_config.mamba_cache_mode = "align"
        return Engine(config, specs=mamba_specs(), v2_runner=True, **kw)

    a = v2_engine(num_blocks=4)  # four prompts of 20 tokens fill it
    rnd = random.Random(8)
    batch = {f"z{i}": [rnd.randrange(50, 950) for _ in range(20)] for i in range(4)}
    saved: set[int] = set()
    reused: list[int] = []
    # Resumes the server whether or not a step waits for it.
    resume = threading.Timer(2.0, server.proc.send_signal, (signal.SIGCONT,))

    def stall_the_first_save(so: object) -> None:
        plan = so.kv_connector_metadata.plan  # type: ignore[attr-defined]
        zeroed = so.new_block_ids_to_zero or ()  # type: ignore[attr-defined]
        if saved:  # the next step: what vLLM hands out, zeroed, of those
            reused.extend(set(zeroed) & saved)
            a.after_schedule = None
        elif plan.saves:
            saved.update(b for job in plan.saves for b in job.block_ids)
            server.proc.send_signal(signal.SIGSTOP)
            resume.start()

    a.after_schedule = stall_the_first_save
    try:
        serve(a, batch, max_tokens=60)
    finally:
        resume.cancel()
        server.proc.send_signal(signal.SIGCONT)
    assert reused  # the case at hand: a block of the stalled Save, reused
    b = v2_engine()
    serve_hitting(b, batch)
    assert b.counters()["hit_tokens"] == len(batch) * BLOCK
    for e in (a, b):
        e.close()


def test_a_failed_load_is_per_request_while_vllm_has_several_groups(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """vLLM keeps groups out of KV transfer (HiSparse: the GPU replicas of its
    host source group), so the connector transfers one group while vLLM has
    four. vLLM takes failed loads per request then (a block id is only unique
    within a group; block-level failures stop the engine): its lease unknown
    to the server, the request is recomputed from the start."""
    pega_server()
    batch = prompts(9, n=1, base=120)
    untransferred = (0, 1, 2)  # the sliding-window groups
    extra = {**FAST, "sync_load_max_tokens": 4096}
    a, b = (
        Engine(
            vllm_config(tiny_model, extra),
            specs=sliding_specs(),
            untransferred=untransferred,
        )
        for _ in range(2)
    )
    serve(a, batch)
    assert len(b.kv_cache_config.kv_cache_groups) == 4
    b.step()
    planned: list[object] = []

    def break_the_lease(so: object) -> None:
        for job in so.kv_connector_metadata.plan.loads:  # type: ignore[attr-defined]
            planned.append(job)
            job.lease_id ^= 2  # unknown to the server: the item fails
        if planned:
            b.after_schedule = None

    b.after_schedule = break_the_lease
    serve(b, batch)
    b.assert_clean()
    (rid,) = batch
    assert [(job.group, job.sync) for job in planned] == [(3, False)]
    assert min(b.seqs[rid].computed) == 0
    counters = b.counters()
    assert counters["load_failures"] == 1
    assert counters["hit_tokens"] == (len(batch[rid]) - 1) // BLOCK * BLOCK
    a.close()
    b.close()


def test_a_scratch_ring_group_is_neither_refused_nor_transferred(
    pega_server: Callable[..., ServerProc], tiny_model: Path
) -> None:
    """vLLM restores from an external hit only its prefix-cacheable groups
    (get_loaded_kv_cache_group_ids). A compressor's ring (CircularBufferSpec:
    one scratch block per request) is not one: the model is served, and B
    hits every group vLLM restores, the ring never moved. Before: refused."""
    pega_server()
    ring = {
        f"model.layers.{i}.self_attn.attn": _attn(FullAttentionSpec) for i in (0, 1, 2)
    }
    ring["model.layers.3.self_attn.attn"] = _attn(CircularBufferSpec)
    a, b = (Engine(vllm_config(tiny_model, FAST), specs=ring) for _ in range(2))
    config = b.kv_cache_config
    restored = config.prefix_cacheable_group_ids
    assert len(config.transfer_group_ids) == 4 and restored == (0, 1, 2)
    assert b.scheduler_connector.get_loaded_kv_cache_group_ids(None) == restored
    assert set(b.worker._worker.parts) == set(restored)
    batch = prompts(11, n=2)
    serve(a, batch)
    a.assert_clean()
    loads = serve_hitting(b, batch)
    for rid in batch:
        groups = sorted(job.group for job in loads[rid])
        assert groups == list(restored), (rid, groups)
    assert b.counters()["hit_tokens"] == sum(
        (len(t) - 1) // BLOCK * BLOCK for t in batch.values()
    )
    a.close()
    b.close()


def mla_specs() -> dict[str, object]:
    """DeepSeek-V4's pattern, shorter: MLA latent layers, and a sliding window
    in MLA's format that vLLM rebuilds after a hit (bounded replay)."""
    latent = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 64}
    mla = MLAAttentionSpec(**latent, dtype=torch.bfloat16)
    window = SlidingWindowMLASpec(
        **latent, dtype=torch.bfloat16, sliding_window=WINDOW, bounded_replay=True
    )
    return {
        f"model.layers.{i}.self_attn.attn": window if i % 2 else mla for i in range(4)
    }


@pytest.mark.parametrize("mla_3d", [False, True], ids=["vllm-0.33", "3d"])
def test_a_window_vllm_replays_after_a_hit_is_not_transferred(
    pega_server: Callable[..., ServerProc], tiny_model: Path, mla_3d: bool
) -> None:
    """DeepSeek-V4's bounded-replay sliding window (SlidingWindowMLASpec,
    bounded_replay) is rebuilt by recomputing the hit's last window, unless
    the connector says it loads it: it is not prefix-cacheable, so we neither
    load it (for nothing) nor tell vLLM we do. B hits A's MLA pages, each
    checked byte by byte before its forward (the replayed window's too: the
    replay leaves them as loaded) and when it finishes; B's window pages change
    only in its forward (Engine.replay_changes). MLA's pages as vLLM 0.33 hands
    them ([blocks, 1, block_size, 64]) and as its kernels view them (3-D).
    Before: transferred as a sliding-window group."""
    pega_server()
    a, b = (
        Engine(vllm_config(tiny_model, FAST), specs=mla_specs(), mla_3d=mla_3d)
        for _ in range(2)
    )
    config = b.kv_cache_config
    assert len(config.transfer_group_ids) == 2
    assert config.prefix_cacheable_group_ids == (0,) and b.replay_groups == {1}
    rules = groups_of(config, BLOCK).rules
    assert [(r.kind, r.layer_names) for r in rules] == [
        ("full", ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"))
    ]
    assert b.scheduler_connector.get_loaded_kv_cache_group_ids(None) == (0,)
    assert {v.dim() for v in b.caches.values()} == {3 if mla_3d else 4}
    batch = prompts(13, n=2)  # 100 and 123 tokens: hits of 96 and 112
    serve(a, batch)
    a.assert_clean()
    b.step()  # an idle step: the workers report (the query socket)
    loads: list = []
    b.after_schedule = lambda so: loads.extend(so.kv_connector_metadata.plan.loads)
    serve(b, batch)
    b.assert_clean()
    assert {job.group for job in loads} == {0}
    for rid, tokens in batch.items():
        hit = (len(tokens) - 1) // BLOCK * BLOCK
        assert min(b.seqs[rid].computed) == hit - WINDOW  # vLLM replayed
        loaded = [b for job in loads if job.req_id == rid for b in job.block_ids]
        assert len(loaded) == hit // BLOCK
    assert b.counters()["hit_tokens"] == sum(
        (len(t) - 1) // BLOCK * BLOCK for t in batch.values()
    )
    a.close()
    b.close()
