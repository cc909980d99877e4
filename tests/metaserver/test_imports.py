"""The metaserver's module rule: it shares values with the server (keys,
errors, boundary, http, config, startup) and pulls in nothing of the engine,
pool, copiers, SSD tier or the server's own metrics."""

from __future__ import annotations

import pytest

from tests.unit.test_import_rules import _closure

FORBIDDEN = (
    "pegaflow.server.engine",
    "pegaflow.server.grpc_service",
    "pegaflow.server",
    "pegaflow.server.socket_service",
    "pegaflow.cache.block_store",
    "pegaflow.cache.block_entry",
    "pegaflow.cache.deferred_touches",
    "pegaflow.cache.pool",
    "pegaflow.cache.slabs",
    "pegaflow.cache.eviction",
    "pegaflow.cache.leases",
    "pegaflow.cache.miss_reasons",
    "pegaflow.cache.ready_index",
    "pegaflow.cache.hash_table",
    "pegaflow.cache.instances",
    "pegaflow.server.namespaces",
    "pegaflow.tiers.ssd_tier",
    "pegaflow.stats",
    "pegaflow.server.metrics",
    "pegaflow.cli",
    "pegaflow.copiers",
    "pegaflow.common.cuda_driver",
    "pegaflow.kernels",
    "pegaflow.gds",
)


@pytest.mark.parametrize(
    "entry", ["pegaflow.metaserver.meta_cli", "pegaflow.metaserver.meta_server"]
)
def test_metaserver_pulls_in_nothing_of_the_server(entry: str) -> None:
    pulled = {
        m
        for m in _closure(entry)
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
    }
    assert "pegaflow.metaserver.meta_config" in _closure(entry)  # the checker sees it
    assert not pulled, f"{entry} pulls in {sorted(pulled)}"
