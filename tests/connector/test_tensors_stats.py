"""KV tensor shapes vLLM hands the worker, the namespace digest, and the
statistics hooks (log line reduction, Prometheus counters)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pegaflow.client.kv_layouts import describe
from pegaflow.connector.tensors import kv_tensors, namespace_digest, namespace_parts
from tests.connector.conftest import needs_vllm

torch = pytest.importorskip("torch")


def config(tp: int = 1, mla: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="m", revision=None, dtype="bf16", use_mla=mla
        ),
        cache_config=SimpleNamespace(
            block_size=16, cache_dtype="auto", prefix_caching_hash_algo="sha256"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def views(order: str, blocks: int = 8, layers: int = 2) -> dict[str, object]:
    """vLLM 0.33 per-layer [B, H, N, C] views of one buffer, N/H order given."""
    buf = torch.zeros(layers * blocks * 2 * 16 * 32, dtype=torch.bfloat16)
    if order == "NHC":
        phys = buf.view(layers, blocks, 16, 2, 32)
        return {f"l{i}": phys[i].permute(0, 2, 1, 3) for i in range(layers)}
    phys = buf.view(layers, blocks, 2, 16, 32)
    return {f"l{i}": phys[i] for i in range(layers)}


def test_page_order_is_part_of_the_namespace() -> None:
    nhc, hnc = kv_tensors(views("NHC"), 8), kv_tensors(views("HNC"), 8)
    assert nhc.page_signature != hnc.page_signature
    digest = {namespace_digest(namespace_parts(config(), kv, "")) for kv in (nhc, hnc)}
    assert len(digest) == 2
    salted = namespace_digest(namespace_parts(config(), nhc, "v2"))
    assert salted not in digest


def test_mla_namespace_is_shared_across_tp_sizes() -> None:
    """MLA's latent KV is whole on every rank: TP=1 and TP=2 engines share it;
    per-rank KV heads (plain TP) make TP sizes incompatible."""
    kv = kv_tensors(views("NHC"), 8)

    def digest(tp: int, mla: bool) -> str:
        return namespace_digest(namespace_parts(config(tp, mla), kv, ""))

    assert digest(1, True) == digest(2, True)
    assert digest(1, False) != digest(2, False)
    assert digest(2, True) != digest(2, False)


def _rope(theta: float) -> SimpleNamespace:
    return SimpleNamespace(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": theta},
        max_position_embeddings=32768,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"quantization": "fp8"},
        {"quantization_config": {"linear": "fp8"}},
        {"hf_overrides": {"rope_parameters": {"rope_theta": 5e5}}},
        {"hf_text_config": _rope(5e5)},
        {"hf_text_config": SimpleNamespace(sliding_window=4096)},
        {"model_weights": "/ckpt/step-2000"},
        {"code_revision": "v2"},
    ],
    ids=[
        "quantization",
        "quantization_config",
        "hf_overrides",
        "rope_theta",
        "sliding_window",
        "model_weights",
        "code_revision",
    ],
)
def test_what_changes_k_or_v_changes_the_namespace(change: dict) -> None:
    """Scenario: an fp8-quantized engine and a bf16 one, or two engines whose
    RoPE theta differs (hf_overrides), cache different K for the same tokens
    in the same page shape; they shared one namespace, so each loaded the
    other's wrong KV. Config that differs only there now gives another
    namespace; the same config gives the same one."""
    kv = kv_tensors(views("NHC"), 8)

    def digest(**model: object) -> str:
        cfg = config()
        base = {
            "quantization": None,
            "hf_overrides": {},
            "hf_text_config": _rope(1e6),
            **model,
        }
        vars(cfg.model_config).update(base)
        return namespace_digest(namespace_parts(cfg, kv, ""))

    assert digest() == digest()
    assert digest(**change) != digest()
    assert digest(**change) == digest(**change)


def test_namespace_parts_are_the_same_in_every_process() -> None:
    """Key order of hf_overrides, and a callable override, give the same
    digest in every process: nothing with an object's address in it."""

    def override_rope(hf_config: object) -> object:
        return hf_config

    cfg = config()
    kv = kv_tensors(views("NHC"), 8)
    cfg.model_config.hf_overrides = {"a": 1, "rope_parameters": {"x": 1, "y": [2]}}
    one = namespace_parts(cfg, kv, "")
    cfg.model_config.hf_overrides = {"rope_parameters": {"y": (2,), "x": 1}, "a": 1}
    assert namespace_digest(namespace_parts(cfg, kv, "")) == namespace_digest(one)
    cfg.model_config.hf_overrides = override_rope
    parts = namespace_parts(cfg, kv, "")
    assert parts["hf_overrides"].endswith("override_rope")
    cfg.model_config.hf_overrides = object()
    assert "0x" not in json.dumps(namespace_parts(cfg, kv, ""), default=str)


def test_real_vllm_configs_differing_in_rope(tiny_model: Path) -> None:
    """The same through vLLM's own ModelConfig: the fields read exist under
    these names in vLLM 0.33, and an hf_overrides RoPE theta reaches them."""
    from vllm.config import ModelConfig

    kv = kv_tensors(views("NHC"), 8)

    def digest(**options: object) -> str:
        model = ModelConfig(
            str(tiny_model), skip_tokenizer_init=True, max_model_len=512, **options
        )
        cfg = SimpleNamespace(
            model_config=model,
            cache_config=config().cache_config,
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )
        return namespace_digest(namespace_parts(cfg, kv, ""))

    theta = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert digest() == digest()
    assert digest(hf_overrides=theta) != digest()
    assert digest(hf_overrides=theta) == digest(hf_overrides=theta)


def test_kernel_blocks_group_into_manager_blocks() -> None:
    """Views split into 2 kernel blocks per manager block register one page
    per manager block, so scheduler block ids address the right bytes."""
    kv = kv_tensors(views("NHC", blocks=16), 8)
    mem = describe(kv.tensors)
    assert mem.layers[0].num_blocks == 8
    assert mem.layers[0].block_stride == 2 * (16 * 2 * 32 * 2)  # 2 kernel pages


def test_kv_first_tensors_and_bad_shapes() -> None:
    older = {f"l{i}": torch.zeros(2, 8, 16, 2, 32) for i in range(2)}
    kv = kv_tensors(older, 8)
    assert (
        kv.kv_first and len(describe(kv.tensors, kv_first=True).layers[0].segments) == 2
    )
    with pytest.raises(ValueError, match="fits neither"):
        kv_tensors({"l0": torch.zeros(7, 2, 16, 32)}, 8)
    with pytest.raises(ValueError, match="page shape or dtype"):
        kv_tensors({"a": torch.zeros(8, 2, 16, 32), "b": torch.zeros(8, 4, 16, 32)}, 8)


def test_stats_reduce_and_prometheus() -> None:
    needs_vllm()
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from pegaflow.connector import PegaKVConnector
    from pegaflow.connector.step_plan import new_stats

    stats = PegaKVConnector.build_kv_connector_stats(
        {**new_stats(), "queries": 2, "query_seconds": 0.004, "query_tokens": 64}
    )
    other = PegaKVConnector.build_kv_connector_stats(
        {"hit_tokens": 32, "load_bytes": 2e6, "load_seconds": 0.001}
    )
    reduced = stats.aggregate(other).reduce()
    assert reduced["queries"] == 2 and reduced["hit_rate"] == 0.5
    assert reduced["query_avg_ms"] == 2.0 and reduced["load_GBps"] == 2.0
    assert PegaKVConnector.build_kv_connector_stats().is_empty()

    registry = CollectorRegistry()

    class RegCounter(Counter):
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(*args, registry=registry, **kw)

    prom = PegaKVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: RegCounter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    prom.observe(stats.data, engine_idx=0)
    assert (
        registry.get_sample_value("vllm:pegaflow_hit_tokens_total", {"engine": "0"})
        == 32
    )


@pytest.mark.parametrize(
    "name", ["decode_context_parallel_size", "prefill_context_parallel_size"]
)
def test_context_parallel_is_refused(name: str) -> None:
    """Context parallelism splits a block's tokens across ranks: neither whole
    per-rank shards nor MLA's replicated KV; refused at construction."""
    needs_vllm()
    from pegaflow.connector.connector import _check_supported

    par = SimpleNamespace(
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    setattr(par, name, 2)
    cfg = SimpleNamespace(parallel_config=par, cache_config=config().cache_config)
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16
    )
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    kv_cfg = SimpleNamespace(kv_cache_groups=[group], hash_block_size=None)
    with pytest.raises(ValueError, match=f"{name} > 1 is not supported"):
        _check_supported(cfg, kv_cfg)
    setattr(par, name, 1)
    _check_supported(cfg, kv_cfg)
