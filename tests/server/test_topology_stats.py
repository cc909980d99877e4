"""For tests/server/ once assembly.py passes Placement.report to engine_stats
(see the multi-GPU report): /stats' topology names where the pool's pages
are, read from a real server process (a host-only one: no GPUs to place)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from tests.procs import ServerProc


def test_stats_report_where_the_pool_pages_are(
    server_factory: Callable[..., ServerProc],
) -> None:
    """Once pre-touched, every sampled pool page is on one of this machine's
    nodes, under the default memory policy; no GPU is listed."""
    srv = server_factory("--pool-size", "64mb", "--devices", "none")
    deadline = time.monotonic() + 60
    while True:
        topo = json.loads(srv.get("/stats")[1])["topology"]
        pool = topo["pool"]
        if pool["not_present"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert pool["not_present"] == 0, pool
    assert sum(pool["pages_by_node"].values()) == pool["sampled_pages"] == 512
    assert {int(n) for n in pool["pages_by_node"]} <= set(topo["nodes"])
    assert pool["policy"] == "default"
    assert topo["gpus"] == []
