"""The metaserver's module rule: it shares values with the server (keys,
errors, boundary, http, config, startup) and pulls in nothing of the engine,
pool, copiers, SSD tier or the server's own metrics."""

from __future__ import annotations

import pytest

from tests.unit.test_import_rules import _closure

FORBIDDEN = (
    "pegaflow.engine",
    "pegaflow.service",
    "pegaflow.server",
    "pegaflow.socket_server",
    "pegaflow.blocks",
    "pegaflow.block_entry",
    "pegaflow.deferred",
    "pegaflow.pool",
    "pegaflow.slabs",
    "pegaflow.policy",
    "pegaflow.leases",
    "pegaflow.misses",
    "pegaflow.ready_index",
    "pegaflow.hash_table",
    "pegaflow.instances",
    "pegaflow.namespaces",
    "pegaflow.ssd",
    "pegaflow.stats",
    "pegaflow.metrics",
    "pegaflow.cli",
    "pegaflow.copiers",
    "pegaflow.cuda_driver",
    "pegaflow.kernels",
    "pegaflow.gds",
)


@pytest.mark.parametrize(
    "entry", ["pegaflow.metaserver.cli", "pegaflow.metaserver.server"]
)
def test_metaserver_pulls_in_nothing_of_the_server(entry: str) -> None:
    pulled = {
        m
        for m in _closure(entry)
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
    }
    assert "pegaflow.metaserver.config" in _closure(entry)  # the checker sees it
    assert not pulled, f"{entry} pulls in {sorted(pulled)}"
