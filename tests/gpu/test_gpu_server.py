"""The GPU data path end to end: a real server process and engine processes that
hold torch CUDA KV on one GPU; bytes move through CUDA IPC and the pool.

Excluded by default (marker `gpu`); on the H200 test machine:
    pytest -m gpu tests/gpu -o addopts="" -p no:cacheprovider
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import pytest

from tests.gpu.conftest import LLAMA, health, tokens, wait_for
from tests.procs import EngineProc, ServerProc, start_server

pytestmark = pytest.mark.gpu

CASES = [
    (layout, dtype)
    for layout in ("LBNHC", "BLNHC", "kv_first", "MLA")
    for dtype in ("bfloat16", "float8_e4m3fn")
]
N = 40


@pytest.fixture(scope="module")
def server(gpu: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("gpu-server")
    args = ("--pool-size", "6gb", "--devices", "0", "--cuda-event-timeout", "5")
    srv = start_server(tmp, *args)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pair(server: ServerProc) -> Iterator[tuple[EngineProc, EngineProc]]:
    a, b = EngineProc(), EngineProc()
    yield a, b
    a.close()
    b.close()


def setup(e: EngineProc, srv: ServerProc, name: str, ns: str, **init: object) -> None:
    e.call("init", device="cuda:0", **init)
    e.call("register", addr=srv.addr, instance=name, namespace=ns)


def save_then_load(
    a: EngineProc, b: EngineProc, hashes: list[str], event: bool = True
) -> tuple[list[str], list[str]]:
    """a writes fresh bytes behind a GPU sleep and saves them (ordered by its IPC
    event); b loads them into other block ids. Returns (a's, b's) digests."""
    n = len(hashes)  # N, unless a test wants fewer
    src = list(range(n))
    dst = [63 - i for i in range(n)]  # other ids, reversed order
    a.call("scribble", block_ids=src, seed=11, delay_ms=150)
    res = a.call("save", block_ids=src, hashes=hashes, event=event, sync=False)
    assert res["stored"] == n
    expected = a.call("digest", block_ids=src)["digests"]  # syncs a's stream
    hit = b.call("query", hashes=hashes)
    assert hit["num_blocks"] == n
    assert b.call("load", lease_id=hit["lease_id"], block_ids=dst)["loaded"] == n
    return expected, b.call("digest", block_ids=dst)["digests"]


@pytest.mark.parametrize(("layout", "dtype"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_round_trip(
    server: ServerProc, pair: tuple[EngineProc, EngineProc], layout: str, dtype: str
) -> None:
    """Engine A saves (its copy waits on A's IPC event), engine B loads into other
    ids: every byte equal, B's other blocks untouched, mappings closed after."""
    a, b = pair
    ns = f"ns-{layout}-{dtype}"
    setup(a, server, f"a-{ns}", ns, layout=layout, dtype=dtype, seed=1, **LLAMA)
    setup(b, server, f"b-{ns}", ns, layout=layout, dtype=dtype, seed=2, **LLAMA)
    assert health(server)["cuda_mappings"] >= 2
    keep = list(range(N, 64 - N))  # blocks b must not see written
    before = b.call("digest", block_ids=keep)["digests"]
    expected, got = save_then_load(a, b, tokens(N))
    assert got == expected
    assert b.call("digest", block_ids=keep)["digests"] == before
    a.call("unregister")
    b.call("unregister")
    assert wait_for(lambda: health(server)["cuda_mappings"] == 0)


def test_save_without_event_races_the_engine(
    server: ServerProc, pair: tuple[EngineProc, EngineProc]
) -> None:
    """Control for the test above: without the event, the server copies before
    A's delayed writes land, so B gets the old bytes. The event is what orders."""
    a, b = pair
    setup(a, server, "a-noevent", "ns-noevent", layout="LBNHC", seed=1, **LLAMA)
    setup(b, server, "b-noevent", "ns-noevent", layout="LBNHC", seed=2, **LLAMA)
    expected, got = save_then_load(a, b, tokens(N), event=False)
    assert got != expected
    a.call("unregister")
    b.call("unregister")


def test_two_models_in_two_namespaces(
    server: ServerProc, engine: Callable[..., EngineProc]
) -> None:
    """A Llama-like and an MLA engine at once, saving the same hashes: each sees
    only its own namespace's blocks and loads its own bytes back."""
    llama, mla = engine(), engine()
    setup(llama, server, "llama", "ns-llama", layout="LBNHC", seed=3, **LLAMA)
    mla_shape = {**LLAMA, "layers": 6}
    setup(mla, server, "mla", "ns-mla", layout="MLA", seed=4, **mla_shape)
    hashes = tokens(N)
    src, dst = list(range(N)), list(range(63, 63 - N, -1))
    for e in (llama, mla):
        assert e.call("save", block_ids=src, hashes=hashes)["stored"] == N
    only_llama = tokens(4)
    llama.call("save", block_ids=[0, 1, 2, 3], hashes=only_llama)
    assert mla.call("query", hashes=only_llama)["num_blocks"] == 0
    for e in (llama, mla):
        expected = e.call("digest", block_ids=src)["digests"]
        hit = e.call("query", hashes=hashes)
        assert hit["num_blocks"] == N
        e.call("load", lease_id=hit["lease_id"], block_ids=dst)
        assert e.call("digest", block_ids=dst)["digests"] == expected
    assert health(server)["workers"] == 2


def test_sigkill_mid_copy(
    server: ServerProc, engine: Callable[..., EngineProc]
) -> None:
    """An engine dies while the server copies 2 GiB out of its GPU memory: the
    server stays healthy, drops the worker, unmaps its allocation, and serves the
    next engine."""
    big = dict(layers=32, blocks=1024, heads=8, block_size=16, head=128)
    victim = engine()
    setup(victim, server, "victim", "ns-kill", layout="LBNHC", seed=5, **big)
    victim.call("save_async", block_ids=list(range(1024)), hashes=tokens(1024))
    victim.kill()
    assert wait_for(lambda: health(server)["workers"] == 0)
    assert wait_for(lambda: health(server)["cuda_mappings"] == 0)
    a, b = engine(), engine()
    expected, got = _fresh_pair(server, a, b, "after-kill")
    assert got == expected


def test_sigkill_with_pending_event(
    server: ServerProc, engine: Callable[..., EngineProc]
) -> None:
    """An engine dies after recording the event its save waits on, behind 1 s of
    GPU work: the save ends (done or failed within --cuda-event-timeout), and the
    server keeps serving other engines' saves and loads."""
    victim = engine()
    setup(victim, server, "victim2", "ns-kill2", layout="LBNHC", seed=6, **LLAMA)
    victim.call(
        "save_async",
        block_ids=list(range(N)),
        hashes=tokens(N),
        event=True,
        delay_ms=1000,
    )
    victim.kill()
    assert wait_for(lambda: health(server)["workers"] == 0)
    time.sleep(6)  # past the event timeout, whichever way the save ended
    print("mappings after a pending-event kill:", health(server)["cuda_mappings"])
    a, b = engine(), engine()
    expected, got = _fresh_pair(server, a, b, "after-kill2")
    assert got == expected
    for e in (a, b):
        e.call("unregister")
    assert wait_for(lambda: health(server)["cuda_mappings"] == 0)


def _fresh_pair(
    server: ServerProc, a: EngineProc, b: EngineProc, ns: str
) -> tuple[list[str], list[str]]:
    setup(a, server, f"a-{ns}", ns, layout="LBNHC", seed=7, **LLAMA)
    setup(b, server, f"b-{ns}", ns, layout="LBNHC", seed=8, **LLAMA)
    return save_then_load(a, b, tokens(N))


def test_vmm_memory_is_refused_clearly(
    gpu: None, engine: Callable[..., EngineProc]
) -> None:
    """PyTorch expandable_segments allocates with the VMM API, which CUDA IPC
    handles cannot share: export refuses and says what to change."""
    e = engine(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    with pytest.raises(RuntimeError, match="expandable_segments"):
        e.call("init", device="cuda:0", layout="LBNHC", seed=1, **LLAMA)


COPY_PATHS = {
    "dma": ("--copy-path", "dma"),
    "auto": ("--copy-path", "auto"),
    "kernel": ("--copy-path", "kernel"),
}


@pytest.mark.parametrize("path", list(COPY_PATHS))
def test_copy_paths_move_the_same_bytes(
    gpu: None,
    server_factory: Callable[..., ServerProc],
    engine: Callable[..., EngineProc],
    path: str,
) -> None:
    """Saves and loads by copy engines (cuMemcpyBatchAsync from numpy arrays,
    forced or chosen by the measured crossover table) and by kernels: every
    byte equal for a one-segment and a K/V-first layout, and the server log
    shows which path moved them."""
    args = ("--pool-size", "2gb", "--devices", "0", *COPY_PATHS[path])
    srv = server_factory(*args)
    for layout in ("LBNHC", "kv_first"):
        a, b = engine(), engine()
        ns = f"ns-{path}-{layout}"
        setup(a, srv, f"a-{ns}", ns, layout=layout, seed=21, **LLAMA)
        setup(b, srv, f"b-{ns}", ns, layout=layout, seed=22, **LLAMA)
        expected, got = save_then_load(a, b, tokens(N))
        assert got == expected
        if path == "auto" and layout == "LBNHC":
            # 2 blocks x 4 layers of 64 KiB pages: the measured table's copy
            # engines (saves of up to 128 such pages); N blocks went by kernel
            expected, got = save_then_load(a, b, tokens(2))
            assert got == expected
    assert ("copy-engine batch" in srv.log.read_text()) == (path != "kernel")
    report = json.loads(srv.get("/stats")[1])["copy_path"]  # what operators see
    assert report["setting"] == COPY_PATHS[path][1]
    if path == "auto":  # auto counts its batches by path, per GPU
        assert report["devices"]["0"]["batches"]["dma"] > 0
        assert srv.metric("pegaflow_copy_batches_total", 'device="0",path="dma"') > 0


def test_copies_awaited_on_the_loop_move_the_same_bytes(
    gpu: None,
    server_factory: Callable[..., ServerProc],
    engine: Callable[..., EngineProc],
) -> None:
    """Loads above one block are launched and awaited on the event loop (the
    first one by a thread: no rate yet; measured.LOOP_MAX_S bounds the rest);
    the bytes are the same, round after round."""
    srv = server_factory("--pool-size", "2gb", "--devices", "0")
    a, b = engine(), engine()
    setup(a, srv, "a-wait", "ns-wait", layout="LBNHC", seed=31, **LLAMA)
    setup(b, srv, "b-wait", "ns-wait", layout="LBNHC", seed=32, **LLAMA)
    for _ in range(4):
        expected, got = save_then_load(a, b, tokens(N))
        assert got == expected
    ways = {w: srv.metric("pegaflow_copy_waits_total", f'way="{w}"')
            for w in ("loop", "late", "thread")}  # fmt: skip
    # every load; a save whose event already completed too
    assert sum(ways.values()) == 8 and ways["loop"] + ways["late"] >= 4
    assert ways["late"] >= 1 and ways["loop"] >= 1  # the first taught the rate


def test_loads_answered_in_flight_land_before_their_event(
    gpu: None,
    server_factory: Callable[..., ServerProc],
    engine: Callable[..., EngineProc],
) -> None:
    """A load naming one of the engine's IPC events as its done_event is
    answered as soon as its copy is queued on the event loop (in flight), the
    event recorded after the copy; the engine waits on its own event and every
    byte is there, round after round (one a copy thread takes, while the pool
    is still pinned, is answered done). An index the engine never registered
    is refused naming done_event, before anything moves."""
    srv = server_factory("--pool-size", "2gb", "--devices", "0")
    a, b = engine(), engine()
    setup(a, srv, "a-flight", "ns-flight", layout="LBNHC", seed=41, **LLAMA)
    setup(b, srv, "b-flight", "ns-flight", layout="LBNHC", seed=42, **LLAMA)
    dst = [63 - i for i in range(N)]
    flights = []
    for round_ in range(5):
        hashes = tokens(N)
        a.call("scribble", block_ids=list(range(N)), seed=50 + round_, delay_ms=50)
        assert a.call("save", block_ids=list(range(N)), hashes=hashes)["stored"] == N
        expected = a.call("digest", block_ids=list(range(N)))["digests"]
        b.call("scribble", block_ids=dst, seed=90 + round_)  # not what loads
        hit = b.call("query", hashes=hashes)
        got = b.call("load", lease_id=hit["lease_id"], block_ids=dst, done_event=True)
        assert got["loaded"] == N
        flights.append(got["in_flight"])
        assert b.call("digest", block_ids=dst)["digests"] == expected
    assert sum(flights) >= 3, flights  # a copy thread's (pinning) answers done
    hashes = tokens(N)
    assert a.call("save", block_ids=list(range(N)), hashes=hashes)["stored"] == N
    hit = b.call("query", hashes=hashes)
    with pytest.raises(Exception, match="done_event: 99"):
        b.call("load", lease_id=hit["lease_id"], block_ids=dst, done_index=99)


def test_a_wait_on_a_load_in_flight_ends_soon_when_its_server_dies(
    gpu: None,
    server_factory: Callable[..., ServerProc],
    engine: Callable[..., EngineProc],
) -> None:
    """SIGKILLed right after answering a load in flight (a 200 MiB copy), the
    server records no event past a copy it no longer runs: the engine's wait
    ends within seconds (the kernel ends its connection, which the wait
    watches), not at its 30 s timeout; the blocks either landed first or the
    wait fails saying the connection ended."""
    srv = server_factory("--pool-size", "2gb", "--devices", "0")
    shape = dict(layers=32, blocks=256, heads=8, block_size=16, head=128)
    a, b = engine(), engine()
    setup(a, srv, "a-kill", "ns-kill", layout="LBNHC", seed=43, **shape)
    setup(b, srv, "b-kill", "ns-kill", layout="LBNHC", seed=44, **shape)
    n = 100  # 200 MiB, ~4 ms: under LOOP_MAX_S, so launched on the loop
    for _ in range(20):  # until the pool is pinned: copies then go in flight
        hashes = tokens(n)
        assert a.call("save", block_ids=list(range(n)), hashes=hashes)["stored"] == n
        hit = b.call("query", hashes=hashes)
        got = b.call("load", lease_id=hit["lease_id"], block_ids=list(range(n)),
                     done_event=True, kill_when_answered=srv.pid)  # fmt: skip
        if got["in_flight"]:
            break
        time.sleep(0.2)
    assert got["in_flight"], "no load went in flight"
    assert got["waited_s"] < 5.0, got
    failed = got["wait_error"]  # "" where the copy landed before the kill
    assert failed == "" or failed.startswith("done_event"), got
    print("wait after the server's SIGKILL:", got)
