"""The connector's worker half on a GPU: TP=2 as two processes on one GPU, KV
buffers laid out as vLLM 0.33 lays them out (one int8 CUDA allocation per rank,
registered through CUDA IPC), a real server process copying with its CUDA
engine; every byte of every block checked. No vLLM on the GPU machine: the rank
processes drive WorkerHalf with a stand-in for the few vllm_config fields it
reads (tests/connector/rank_proc.py).

Excluded by default (marker `gpu`); on the H200 test machine:
    pytest -m gpu tests/connector/test_gpu_connector.py -o addopts="" \\
        -p no:cacheprovider
"""

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

pytestmark = pytest.mark.gpu

# Llama-like pages of 32 KiB per layer and block; DeepSeek-like MLA pages.
SHAPE = dict(layers=8, blocks=64, block_size=16, heads=8)
CASES = [(False, "LBNHC"), (False, "BLNHC"), (True, "LBNHC")]


@pytest.fixture(scope="module")
def server(gpu: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("gpu-connector")
    args = ("--pool-size", "1gb", "--devices", "0", "--cuda-event-timeout", "10")
    srv = start_server(tmp, *args)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ranks(gpu: None) -> Iterator[list[RankProc]]:
    with rank_procs() as procs:
        yield procs


@pytest.mark.parametrize(
    ("mla", "layout"), CASES, ids=["tp-LBNHC", "tp-BLNHC", "mla-once"]
)
def test_tp2_round_trip_on_gpu(
    server: ServerProc, ranks: list[RankProc], mla: bool, layout: str
) -> None:
    """As the CPU test: A's two ranks save one step's blocks (MLA striped and
    stored once), B's two ranks load three requests in one Load per kind; a
    gone lease fails only its request; loaded pages equal A's bytes."""
    tag = f"gpu-{layout}-{mla}"
    tp2_round_trip(server, ranks, mla, "cuda:0", tag, layout=layout, **SHAPE)
    assert server.proc.poll() is None


def test_hybrid_layout_on_gpu(server: ServerProc, ranks: list[RankProc]) -> None:
    """A sliding-window attention group and a Mamba state group (its own page
    size) in one int8 CUDA allocation per rank, each group registered as its
    own part through CUDA IPC; per-group loads checked byte for byte."""
    hybrid_round_trip(server, ranks, "cuda:0", tag="gpu", **SHAPE)
    assert server.proc.poll() is None
