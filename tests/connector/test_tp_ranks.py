"""TP=2 on the CPU: two rank processes run the connector's worker half against a
real server. Plain TP stores one shard per rank; MLA stores each block once
(saves striped across ranks) and every rank loads it. One Load per step carries
every request's lease; a gone lease fails only its own request's blocks. A
hybrid layout registers each KV cache group as a part of its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.connector.ranks import (
    RankProc,
    hybrid_round_trip,
    rank_procs,
    tp2_round_trip,
)
from tests.procs import ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("tp-ranks"), "--pool-size", "64mb")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[RankProc]]:
    with rank_procs() as procs:
        yield procs


@pytest.mark.parametrize(
    ("mla", "layout"),
    [(False, "BLNHC"), (True, "LBNHC")],
    ids=["tp-shards", "mla-once"],
)
def test_tp2_round_trip(
    server: ServerProc, ranks: list[RankProc], mla: bool, layout: str
) -> None:
    tp2_round_trip(server, ranks, mla, "cpu", tag=f"cpu-{mla}", layout=layout)


def test_hybrid_layout_round_trip(server: ServerProc, ranks: list[RankProc]) -> None:
    """A sliding-window group and a Mamba state group, one buffer, two ranks."""
    hybrid_round_trip(server, ranks, "cpu", tag="cpu")
