"""/metrics carries the original PegaFlow server's metric names beside ours, no
`_created` series, the transport as its own label and a namespace info metric."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.keys import namespace_tag
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc

# The original's series (its docs/metrics.md) that mean something here.
ORIGINAL = {
    "pegaflow_pool_used_bytes": "gauge",
    "pegaflow_pool_capacity_bytes": "gauge",
    "pegaflow_pool_alloc_failures_total": "counter",
    "pegaflow_cache_block_hits_total": "counter",
    "pegaflow_cache_block_misses_total": "counter",
    "pegaflow_cache_tier_block_requests_total": "counter",
    "pegaflow_cache_block_insertions_total": "counter",
    "pegaflow_cache_block_evictions_total": "counter",
    "pegaflow_cache_resident_blocks": "gauge",
    "pegaflow_hll_cardinality": "gauge",
    "pegaflow_hll_total_requests": "gauge",
    "pegaflow_hll_estimated_hit_rate": "gauge",
    "pegaflow_save_bytes_total": "counter",
    "pegaflow_save_duration_seconds": "histogram",
    "pegaflow_load_bytes_total": "counter",
    "pegaflow_load_duration_seconds": "histogram",
    "pegaflow_load_failures_total": "counter",
    "pegaflow_ssd_write_bytes_total": "counter",
    "pegaflow_ssd_prefetch_success_total": "counter",
    "pegaflow_ssd_prefetch_failures_total": "counter",
    "pegaflow_ssd_prefetch_duration_seconds": "histogram",
    "pegaflow_rpc_requests_total": "counter",
    "pegaflow_rpc_duration_seconds": "histogram",
}


def _types(text: str) -> dict[str, str]:
    """Family name -> type, from the # TYPE lines (a counter's ends in _total)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            out[name] = kind
    return out


def test_original_metric_names_are_scraped(
    server_factory: Callable[..., ServerProc], tmp_path: Path
) -> None:
    """Scenario: a dashboard built for the original queries its names; none
    existed, 17 `_created` series were noise and the socket's queries showed
    as method="QueryPrefix/unix"."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    server = server_factory(
        "--pool-size", "4mb", "--ssd-cache-path", str(ssd),
        "--ssd-cache-capacity", "16mb", "--metric-hll-windows", "1m,1h",
    )  # fmt: skip
    kv = LocalKV(layers=4, blocks=32, page=4096, seed=3)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "e", "model-a")
        hs = hashes(32)
        assert client.query("e", hs).num_blocks == 0
        client.save("e", list(range(32)), hs)
        hit = client.query("e", hs)
        assert hit.num_blocks == 32
        client.load("e", hit.lease_id, list(range(32)))
        _, body = server.get("/metrics")
    text = body.decode()
    types = _types(text)
    for name, kind in ORIGINAL.items():
        assert types.get(name) == kind, (name, types.get(name))
    assert "_created" not in text
    assert server.metric("pegaflow_cache_block_hits_total") == 32
    assert server.metric("pegaflow_cache_block_misses_total") == 32
    tier = "pegaflow_cache_tier_block_requests_total"
    assert server.metric(tier, 'tier="ram"') == 32
    assert server.metric(tier, 'tier="miss"') == 32
    assert server.metric("pegaflow_save_bytes_total") == 32 * (kv.layers * kv.page)
    assert server.metric("pegaflow_hll_total_requests", 'window="1m"') == 64
    # 64 queried, 32 first seen by a miss: an infinite cache hits half
    assert server.metric("pegaflow_hll_estimated_hit_rate", 'window="1m"') >= 0.5
    via = "pegaflow_rpc_seconds_count"
    assert server.metric(via, 'code="OK",method="QueryPrefix",transport="unix"') == 2
    assert "/unix" not in text
    assert server.metric("pegaflow_rpc_requests_total", 'method="QueryPrefix"') == 2
    tag = namespace_tag("model-a")
    assert f'pegaflow_namespace_info{{block_bytes="{(kv.layers * kv.page)}"' in text
    assert f'namespace="{tag}"' in text and "model-a" not in text
