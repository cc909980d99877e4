"""SSD hits read by kvikio straight into a CUDA engine's GPU blocks
(--ssd-gpu-direct on), end to end: engine A saves into a server with an SSD
tier (written behind on seal), the server restarts on the same SSD file with
an empty L1, and engine B's query is answered ready at once, its load reads
the records into B's GPU blocks: every byte equal. A record damaged on disk
fails the load, naming the blocks to recompute.

On the H200 test machine kvikio runs in its compatibility mode (no
nvidia-fs), which `on` takes all the same:
    pytest -m gpu tests/gpu -o addopts="" -p no:cacheprovider
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.gpu.test_gpu_server import LLAMA, N, health, setup, tokens, wait_for
from tests.procs import EngineProc, ServerProc, start_server
from tests.server.test_ssd_tier import _flip_payload

# The route needs kvikio in the server: without it `on` is refused at start
# (its own test, tests/server/test_ssd_tier.py), so there is nothing to run.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("kvikio") is None,
        reason="kvikio is not installed (pip install 'pegaflow-py[gds]')",
    ),
]

NS = "ns-ssd-direct"
KV = dict(layout="LBNHC", dtype="bfloat16", **LLAMA)


@pytest.fixture
def engine() -> Iterator[Callable[[], EngineProc]]:
    made: list[EngineProc] = []

    def make() -> EngineProc:
        made.append(EngineProc())
        return made[-1]

    yield make
    for proc in made:
        proc.close()


def _start(tmp: Path) -> ServerProc:
    return start_server(
        tmp,
        *("--pool-size", "1gb", "--devices", "0", "--ssd-backend", "posix"),
        *("--ssd-cache-path", str(tmp / "ssd.bin"), "--ssd-cache-capacity", "512mb"),
        *("--ssd-gpu-direct", "on"),
    )


def _saved_to_ssd(tmp: Path, a: EngineProc, hashes: list[str]) -> list[str]:
    """A saves N fresh blocks, written behind to the SSD; the server then
    stops (its L1 goes with it). A's digests of them."""
    first = _start(tmp)
    try:
        setup(a, first, "a", NS, seed=1, **KV)
        src = list(range(N))
        a.call("scribble", block_ids=src, seed=7)
        assert a.call("save", block_ids=src, hashes=hashes)["stored"] == N
        written = "pegaflow_ssd_written_blocks_total"
        assert wait_for(lambda: first.metric(written) >= N)
        a.call("unregister")
        return a.call("digest", block_ids=src)["digests"]
    finally:
        assert first.stop() == 0


def test_ssd_hits_land_straight_in_gpu_blocks(
    gpu: None, tmp_path: Path, engine: Callable[[], EngineProc]
) -> None:
    hashes = tokens(N)
    expected = _saved_to_ssd(tmp_path, engine(), hashes)
    second = _start(tmp_path)
    try:
        assert health(second)["ssd_gpu_route"] == "direct"
        b = engine()
        setup(b, second, "b", NS, seed=2, **KV)
        hit = b.call("query", hashes=hashes)
        assert hit["num_blocks"] == N and not hit["loading"] and hit["lease_id"]
        dst = [63 - i for i in range(N)]
        assert b.call("load", lease_id=hit["lease_id"], block_ids=dst)["loaded"] == N
        assert b.call("digest", block_ids=dst)["digests"] == expected
        loaded = 'result="loaded"'
        assert second.metric("pegaflow_ssd_direct_blocks_total", loaded) == N
        assert second.metric("pegaflow_resident_blocks") == 0  # no L1 hop
    finally:
        assert second.stop() == 0


def test_a_damaged_record_fails_the_load_for_a_recompute(
    gpu: None, tmp_path: Path, engine: Callable[[], EngineProc]
) -> None:
    hashes = tokens(N)
    _saved_to_ssd(tmp_path, engine(), hashes)
    _flip_payload(tmp_path / "ssd.bin", bytes.fromhex(hashes[5]))
    second = _start(tmp_path)
    try:
        b = engine()
        setup(b, second, "b", NS, seed=2, **KV)
        hit = b.call("query", hashes=hashes)
        assert hit["num_blocks"] == N and not hit["loading"]
        with pytest.raises(RuntimeError, match="1 of the blocks read from the SSD"):
            b.call("load", lease_id=hit["lease_id"], block_ids=list(range(N)))
        failed = 'result="failed"'
        assert second.metric("pegaflow_ssd_direct_blocks_total", failed) == 1
    finally:
        assert second.stop() == 0
