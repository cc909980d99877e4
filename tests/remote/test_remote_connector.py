"""The vLLM connector across nodes: engine A (real vLLM 0.33 scheduler) on node
0 computes and saves, engine B on node 1 gets its prefix from node 0 through
the remote tier, and its pages equal A's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.connector.conftest import needs_vllm
from tests.remote.conftest import SERVER_PORT, Cluster

needs_vllm()

from tests.connector.engine import BLOCK, Engine, vllm_config  # noqa: E402
from tests.connector.test_two_engines import hit_tokens, prompts, serve  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _extra(cluster: Cluster, node: int) -> dict:
    return {
        "pegaflow.host": f"http://{cluster.nodes[node].address}",
        "pegaflow.port": SERVER_PORT,
        "retry_interval_s": 0.2,
    }


def test_engine_on_another_node_hits_through_the_remote_tier(
    cluster: Cluster, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PEGAFLOW_HOST", "PEGAFLOW_PORT"):  # they would win over extra
        monkeypatch.delenv(name, raising=False)
    batch = prompts(7)
    a = Engine(vllm_config(tiny_model, _extra(cluster, 0)), "LBNHC")
    serve(a, batch)
    a.assert_clean()
    saved = a.counters()["save_blocks"]
    assert saved == sum((len(t) + 3) // BLOCK for t in batch.values())
    cluster.wait_remote(0, lambda r: r["advertised"] >= saved, "advertising")

    b = Engine(vllm_config(tiny_model, _extra(cluster, 1)), "LBNHC")
    b.step()  # an idle step: the worker tells the scheduler the query socket
    for rid, tokens in batch.items():
        b.add(rid, tokens, max_tokens=4)
    b.run()
    assert b.errors == []  # every page of every finished request is A's bytes
    expected = sum(hit_tokens(t, len(t)) for t in batch.values())
    assert b.counters()["hit_tokens"] == expected
    assert b.seen_waiting_remote == set(batch)  # it waited while node 1 fetched
    remote = cluster.remote(1)
    assert remote["fetched_blocks"] >= expected // BLOCK
    assert all(v == 0 for v in remote["failed_blocks"].values()), remote
    b.assert_clean()
    a.close()
    b.close()
