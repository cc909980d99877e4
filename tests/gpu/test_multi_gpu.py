"""One server, several GPUs: TP ranks each on its own GPU (engine processes
that see every GPU and use one, as vLLM's workers), through a real server and
the one pool every GPU copies into at once.

Each test needs a number of GPUs and skips, naming it, when fewer are visible.
Excluded by default (marker `gpu`); on a multi-GPU machine:
    pytest -m gpu tests/gpu/test_multi_gpu.py -o addopts="" -p no:cacheprovider
(benchmarks/gpu_runner.sh's `multi` step runs this with every visible GPU.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.gpu.conftest import LLAMA, health, tokens, wait_for
from tests.procs import EngineProc, ServerProc, start_server

pytestmark = pytest.mark.gpu

N = 40  # blocks per save: 10 MiB a rank
BIG = dict(layers=32, blocks=1024, heads=8, block_size=16, head=128)  # 2 GiB


def visible_gpus() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need(gpus: int) -> int:
    """Skip unless `gpus` GPUs are visible; returns how many are."""
    have = visible_gpus()
    if have < gpus:
        pytest.skip(f"needs {gpus} GPUs, {have} visible")
    return have


@pytest.fixture(scope="module")
def server(gpu: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """Serving every visible GPU (at least 2), with room for TP 8's saves and
    the SIGKILL test's 2 GiB."""
    have = need(2)
    devices = ",".join(str(d) for d in range(have))
    tmp = tmp_path_factory.mktemp("multi-gpu")
    srv = start_server(
        tmp, "--pool-size", "8gb", "--devices", devices, "--cuda-event-timeout", "5"
    )
    yield srv
    srv.stop()


def on_each(procs: list[EngineProc], op: str, **kw: object) -> list[dict]:
    """`op` on every process at once (each its own GPU): the server copies
    for all of them concurrently."""
    with ThreadPoolExecutor(len(procs)) as pool:
        futures = [pool.submit(p.call, op, 120.0, **kw) for p in procs]
        return [f.result() for f in futures]


def ranks(
    make: Callable[..., EngineProc],
    srv: ServerProc,
    instance: str,
    devices: list[int],
    seed: int,
    layout: str = "LBNHC",
    replicated: bool = False,
    shape: dict | None = None,
    namespace: str | None = None,
) -> list[EngineProc]:
    """TP len(devices): rank r on GPU devices[r], its own KV bytes (seed + r;
    replicated KV, MLA's latent cache, is the same on every rank), in
    `namespace` (default ns-<instance>)."""
    procs = [make() for _ in devices]
    for r, (proc, device) in enumerate(zip(procs, devices, strict=True)):
        proc.call(
            "init", device=f"cuda:{device}", layout=layout,
            seed=seed if replicated else seed + r, **(shape or LLAMA),
        )  # fmt: skip
        proc.call(
            "register", addr=srv.addr, instance=instance,
            namespace=namespace or f"ns-{instance}", tp_rank=r, tp_size=len(devices),
            replicated=replicated,
        )  # fmt: skip
    return procs


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_ranks_on_their_own_gpus(
    server: ServerProc, engine: Callable[..., EngineProc], tp: int
) -> None:
    """TP `tp`, rank r on GPU r: every rank writes fresh bytes behind a GPU
    sleep and saves at once (each copy after its own rank's IPC event, on its
    own GPU); a block is a hit only with every shard landed. A second
    instance, rank r on GPU r + 1, loads them into other ids: every page of
    every rank equal (read from the pool by another GPU than wrote it), no
    other block touched, every mapping closed after."""
    need(tp)
    ns = f"ns-tp{tp}"
    a = ranks(engine, server, f"tp{tp}-a", list(range(tp)), 100, namespace=ns)
    shifted = [(r + 1) % tp for r in range(tp)]
    b = ranks(engine, server, f"tp{tp}-b", shifted, 200, namespace=ns)
    assert health(server)["cuda_mappings"] >= 2 * tp
    hashes = tokens(N)
    src, dst = list(range(N)), [63 - i for i in range(N)]
    keep = list(range(N, 64 - N))
    before = [p.call("digest", block_ids=keep)["digests"] for p in b]
    on_each(a, "scribble", block_ids=src, seed=11, delay_ms=150)
    saved = on_each(a, "save", block_ids=src, hashes=hashes, event=True, sync=False)
    assert [s["stored"] for s in saved] == [N] * tp
    expected = [p.call("digest", block_ids=src)["digests"] for p in a]
    hit = b[0].call("query", hashes=hashes)
    assert hit["num_blocks"] == N
    loaded = on_each(b, "load", lease_id=hit["lease_id"], block_ids=dst)
    assert [x["loaded"] for x in loaded] == [N] * tp
    got = [p.call("digest", block_ids=dst)["digests"] for p in b]
    for r in range(tp):
        assert got[r] == expected[r], f"rank {r}'s bytes differ after the load"
    assert [p.call("digest", block_ids=keep)["digests"] for p in b] == before
    on_each(a + b, "unregister")
    assert wait_for(lambda: health(server)["cuda_mappings"] == 0)


def test_mla_is_stored_once_and_read_by_every_gpu(
    server: ServerProc, engine: Callable[..., EngineProc]
) -> None:
    """MLA on every visible GPU (up to 8): the latent KV is the same on every
    rank, so one rank (GPU 0) writes a block once for all; the pool grows by
    one copy, another rank's save of it is a duplicate, and every rank loads
    it into its own GPU, byte for byte."""
    tp = min(need(2), 8)
    procs = ranks(
        engine, server, "mla", list(range(tp)), seed=7, layout="MLA", replicated=True
    )
    hashes = tokens(N)
    src, dst = list(range(N)), [63 - i for i in range(N)]
    used = server.metric("pegaflow_pool_used_bytes")
    procs[0].call("scribble", block_ids=src, seed=12, delay_ms=100)
    res = procs[0].call("save", block_ids=src, hashes=hashes, event=True, sync=False)
    assert res["stored"] == N
    expected = procs[0].call("digest", block_ids=src)["digests"]
    slot = server.metric("pegaflow_pool_used_bytes") - used
    layers = LLAMA["layers"]
    assert slot == N * layers * LLAMA["block_size"] * 576 * 2  # one copy, bf16
    again = procs[-1].call("save", block_ids=src, hashes=hashes)
    assert again["deduplicated"] == N and again["stored"] == 0
    hit = procs[1].call("query", hashes=hashes)
    assert hit["num_blocks"] == N
    loaded = on_each(procs, "load", lease_id=hit["lease_id"], block_ids=dst)
    assert [x["loaded"] for x in loaded] == [N] * tp
    for r, p in enumerate(procs):
        assert p.call("digest", block_ids=dst)["digests"] == expected, r
    assert wait_for(lambda: server.metric("pegaflow_active_leases") == 0)
    on_each(procs, "unregister")
    assert wait_for(lambda: health(server)["cuda_mappings"] == 0)


def test_a_rank_killed_mid_copy_while_the_others_copy(
    server: ServerProc, engine: Callable[..., EngineProc]
) -> None:
    """The engine on the last GPU dies while the server copies 2 GiB out of
    it; meanwhile a pair of engines on every other GPU saves and loads. No
    hang, the pairs' bytes right, the dead engine's worker and mapping gone,
    no GPU marked broken, and a new engine on the dead one's GPU is served."""
    have = need(2)
    last = have - 1
    victim = engine()
    victim.call("init", device=f"cuda:{last}", layout="LBNHC", seed=5, **BIG)
    victim.call("register", addr=server.addr, instance="victim", namespace="ns-kill")
    pairs = []
    for d in range(last):
        a, b = ranks(engine, server, f"live{d}", [d], seed=30 + d)[0], engine()
        b.call("init", device=f"cuda:{d}", layout="LBNHC", seed=60 + d, **LLAMA)
        b.call("register", addr=server.addr, instance=f"live{d}-b",
               namespace=f"ns-live{d}")  # fmt: skip
        pairs.append((a, b))
    live_mappings = health(server)["cuda_mappings"] - 1

    def copies(pair: tuple[EngineProc, EngineProc]) -> bool:
        a, b = pair
        ok = True
        for _ in range(3):  # before, across and after the kill
            hashes = tokens(N)
            a.call("scribble", block_ids=list(range(N)), seed=13, delay_ms=20)
            a.call("save", block_ids=list(range(N)), hashes=hashes, event=True,
                   sync=False)  # fmt: skip
            want = a.call("digest", block_ids=list(range(N)))["digests"]
            hit = b.call("query", hashes=hashes)
            dst = [63 - i for i in range(N)]
            b.call("load", lease_id=hit["lease_id"], block_ids=dst)
            ok &= b.call("digest", block_ids=dst)["digests"] == want
        return ok

    with ThreadPoolExecutor(len(pairs)) as pool:
        victim.call("save_async", block_ids=list(range(1024)), hashes=tokens(1024))
        running = [pool.submit(copies, pair) for pair in pairs]
        victim.kill()
        assert all(f.result(timeout=180) for f in running), "a live pair's bytes"
    assert wait_for(lambda: health(server)["workers"] == 2 * len(pairs))
    assert wait_for(lambda: health(server)["cuda_mappings"] == live_mappings)
    doc = health(server)
    assert doc["status"] == "ok" and doc["cuda_faults"] == {}, doc
    after = ranks(engine, server, "after-kill", [last], seed=90)[0]
    hashes = tokens(N)
    after.call("save", block_ids=list(range(N)), hashes=hashes)
    want = after.call("digest", block_ids=list(range(N)))["digests"]
    hit = after.call("query", hashes=hashes)
    after.call("load", lease_id=hit["lease_id"], block_ids=[63 - i for i in range(N)])
    got = after.call("digest", block_ids=[63 - i for i in range(N)])["digests"]
    assert got == want


def test_devices_subset_refuses_a_gpu_it_does_not_serve(
    gpu: None, tmp_path: Path, engine: Callable[..., EngineProc]
) -> None:
    """A server on GPU 1 only (its pool registered and kernels warmed there,
    not on GPU 0): a rank on GPU 0 is refused, naming --devices; a rank on
    GPU 1 round-trips its bytes."""
    need(2)
    srv = start_server(tmp_path, "--pool-size", "1gb", "--devices", "1")
    try:
        outsider = engine()
        outsider.call("init", device="cuda:0", layout="LBNHC", seed=1, **LLAMA)
        with pytest.raises(RuntimeError, match="--devices") as refused:
            outsider.call("register", addr=srv.addr, instance="out", namespace="ns")
        assert "device_uuid" in str(refused.value)
        a = ranks(engine, srv, "in", [1], seed=2)[0]
        hashes = tokens(N)
        a.call("save", block_ids=list(range(N)), hashes=hashes)
        want = a.call("digest", block_ids=list(range(N)))["digests"]
        hit = a.call("query", hashes=hashes)
        dst = [63 - i for i in range(N)]
        a.call("load", lease_id=hit["lease_id"], block_ids=dst)
        assert a.call("digest", block_ids=dst)["digests"] == want
        assert health(srv)["status"] == "ok"
    finally:
        srv.stop()


def test_devices_listed_out_of_order(
    gpu: None, tmp_path: Path, engine: Callable[..., EngineProc]
) -> None:
    """--devices 1,0: the pool is pinned from GPU 1 and each rank still finds
    its own GPU by UUID (not by its place in the list): TP 2 round-trips."""
    need(2)
    srv = start_server(tmp_path, "--pool-size", "1gb", "--devices", "1,0")
    try:
        a = ranks(engine, srv, "rev-a", [0, 1], seed=40, namespace="ns-rev")
        b = ranks(engine, srv, "rev-b", [1, 0], seed=50, namespace="ns-rev")
        hashes = tokens(N)
        saved = on_each(a, "save", block_ids=list(range(N)), hashes=hashes)
        assert [s["stored"] for s in saved] == [N, N]
        want = [p.call("digest", block_ids=list(range(N)))["digests"] for p in a]
        hit = b[0].call("query", hashes=hashes)
        dst = [63 - i for i in range(N)]
        on_each(b, "load", lease_id=hit["lease_id"], block_ids=dst)
        assert [p.call("digest", block_ids=dst)["digests"] for p in b] == want
    finally:
        srv.stop()
