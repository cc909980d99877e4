"""A server restart under vLLM engines (issue 13): engine A (the real
Scheduler) saves a batch, the server is SIGKILLed with every block still in
DRAM (nothing evicted) and restarted on the same files and port; engine B, a
new engine, serves the same prompts. With --pool-file every block A saved is
back, and B hits all of it byte-equal; with only the SSD tier, what survives
depends on --ssd-write-on."""

from __future__ import annotations

import json
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.connector.conftest import needs_vllm
from tests.procs import ServerProc

needs_vllm()

from tests.connector.engine import Engine, vllm_config  # noqa: E402
from tests.connector.test_two_engines import (  # noqa: E402
    FAST,
    hit_tokens,
    prompts,
    serve,
)

SHM = Path("/dev/shm")


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """Where a pool file goes on a server host: /dev/shm where there is one."""
    if not SHM.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=SHM, prefix="pegaflow-test-") as d:
        yield Path(d)


def _flags(ssd: Path, write_on: str, pool: Path | None) -> list[str]:
    flags = ["--ssd-cache-path", str(ssd), "--ssd-cache-capacity", "64mb"]
    flags += ["--ssd-backend", "posix", "--ssd-write-on", write_on]
    return flags + (["--pool-file", str(pool)] if pool else [])


def _written(server: ServerProc, n: int, timeout: float = 20.0) -> None:
    """Until n blocks are on the SSD with nothing left in the write queue."""
    deadline = time.monotonic() + timeout
    done = 0.0
    while time.monotonic() < deadline:
        done = server.metric("pegaflow_ssd_written_blocks_total")
        if done >= n and server.metric("pegaflow_ssd_queue_depth") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{done} of {n} blocks written to the SSD")


def _save_then_kill(
    flags: list[str],
    start: Callable[..., ServerProc],
    model: Path,
    batch: dict[str, list[int]],
) -> int:
    """Engine A serves the batch and saves; the server is SIGKILLed. Returns
    the blocks A saved (all acknowledged: A's saves are done)."""
    server = start(*flags)
    a = Engine(vllm_config(model, FAST))
    serve(a, batch)
    a.assert_clean()
    saved = int(a.counters()["save_blocks"])
    a.close()
    assert saved and server.metric("pegaflow_evictions_total") == 0
    assert server.metric("pegaflow_resident_blocks") == saved  # all in DRAM
    if "seal" in flags:  # write-behind: on the SSD before the kill
        _written(server, saved)
    server.stop(signal.SIGKILL)
    return saved


def _serve_b(model: Path, batch: dict[str, list[int]]) -> Engine:
    """Engine B, new, serves the batch (serve checks every page's bytes)."""
    b = Engine(vllm_config(model, FAST))
    b.step()  # an idle step: the worker tells the scheduler the query socket
    serve(b, batch)
    b.assert_clean()
    b.close()
    return b


@pytest.mark.parametrize("write_on", ["seal", "evict"])
def test_engine_b_hits_every_block_a_saved_after_sigkill_on_a_pool_file(
    pega_server: Callable[..., ServerProc],
    tiny_model: Path,
    tmp_path: Path,
    shm_dir: Path,
    write_on: str,
) -> None:
    """Scenario: a server on a pool file (in /dev/shm) and an SSD file; A
    saves, the server is SIGKILLed (no eviction: the blocks are in DRAM, and
    on the SSD too with write-behind), a new server starts on the same files
    and port. It recovers every block A saved from the pool file, and B hits
    every full block of its prompts from the pool (no SSD read), byte-equal."""
    flags = _flags(tmp_path / "ssd.bin", write_on, shm_dir / "pool.bin")
    batch = prompts(21)
    saved = _save_then_kill(flags, pega_server, tiny_model, batch)

    server = pega_server(*flags)
    report = json.loads(server.get("/health")[1])["pool_recovered"]
    assert (report["blocks"], report["torn"], report["bad_checksum"]) == (saved, 0, 0)
    b = _serve_b(tiny_model, batch)
    counters = b.counters()
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert counters["load_failures"] == 0
    for rid, tokens in batch.items():
        computed = [p for p in b.seqs[rid].computed if p < len(tokens)]
        assert len(computed) == len(tokens) - hit_tokens(tokens, len(tokens)), rid
    assert server.metric("pegaflow_ssd_load_blocks_total") == 0  # all from L1


def test_ssd_write_behind_alone_survives_sigkill(
    pega_server: Callable[..., ServerProc], tiny_model: Path, tmp_path: Path
) -> None:
    """Scenario: no pool file, --ssd-write-on seal: A's blocks reach the SSD
    while still in DRAM; after the SIGKILL and restart, B's prompts miss the
    (empty) pool, load from the SSD, and every full block is a hit."""
    flags = _flags(tmp_path / "ssd.bin", "seal", None)
    batch = prompts(22)
    saved = _save_then_kill(flags, pega_server, tiny_model, batch)

    server = pega_server(*flags)
    assert server.metric("pegaflow_ssd_blocks") == saved
    b = _serve_b(tiny_model, batch)
    counters = b.counters()
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert server.metric("pegaflow_ssd_load_hit_blocks_total") > 0


def test_ssd_write_on_evict_without_pool_file_loses_dram_blocks(
    pega_server: Callable[..., ServerProc], tiny_model: Path, tmp_path: Path
) -> None:
    """Scenario: the documented loss (docs/operations.md, restart behaviour):
    no pool file and --ssd-write-on evict; nothing was evicted, so nothing
    reached the SSD, and the SIGKILL takes every block with the process: the
    restarted server holds none and B gets no hit (and computes right)."""
    flags = _flags(tmp_path / "ssd.bin", "evict", None)
    batch = prompts(23)
    _save_then_kill(flags, pega_server, tiny_model, batch)

    server = pega_server(*flags)
    assert server.metric("pegaflow_ssd_blocks") == 0
    b = _serve_b(tiny_model, batch)
    assert b.counters().get("hit_tokens", 0) == 0
    for rid, tokens in batch.items():
        computed = [p for p in b.seqs[rid].computed if p < len(tokens)]
        assert len(computed) == len(tokens), rid


def test_loads_granted_while_engine_b_reregisters_wait_for_it(
    pega_server: Callable[..., ServerProc], tiny_model: Path, shm_dir: Path
) -> None:
    """Scenario: engine B runs through a server SIGKILL and a restart on the
    pool file. The new server counts B's registration from its RegisterKV on,
    so B's scheduler may be granted hits while B's worker is still opening
    its session (seen in the real-engine suite on a busy host: every load
    failed "not registered", B recomputed all of it). The worker's Load waits
    for that attempt instead, and B loads every block, byte-equal."""
    flags = ["--pool-file", str(shm_dir / "pool.bin")]
    batch = prompts(22)
    server = pega_server(*flags)
    a = Engine(vllm_config(tiny_model, FAST))
    serve(a, batch)
    a.assert_clean()
    a.close()
    b = Engine(vllm_config(tiny_model, FAST))
    b.step()  # registered, the query socket known
    registrar = b.worker._worker.registrar
    assert registrar.registered
    server.stop(signal.SIGKILL)
    server = pega_server(*flags)

    opened = threading.Event()
    session_gate = threading.Event()
    open_session = registrar.client.open_session

    def gated_open_session(*args: object, **kwargs: object) -> object:
        opened.set()
        session_gate.wait(30)
        return open_session(*args, **kwargs)

    registrar.client.open_session = gated_open_session  # type: ignore[method-assign]
    deadline = time.monotonic() + 20
    while not opened.is_set():  # the lost session noticed, an attempt under way
        assert time.monotonic() < deadline, "B never tried to re-register"
        b.step()
        time.sleep(0.01)
    assert json.loads(server.get("/health")[1])["workers"] == 1
    assert not registrar.registered
    threading.Timer(0.5, session_gate.set).start()
    serve(b, {f"{rid}-b": t for rid, t in batch.items()})
    counters = b.counters()
    assert counters["load_failures"] == 0
    assert counters["hit_tokens"] == sum(hit_tokens(t, len(t)) for t in batch.values())
    assert registrar.registered
    b.assert_clean()
    b.close()


def test_a_load_does_not_wait_for_a_registration_queued_behind_it() -> None:
    """The registration attempt shares the worker's I/O pool with the loads:
    one still queued may be waiting for the very thread a load holds, so the
    load fails at once (vLLM recomputes), never after the whole deadline."""
    from concurrent.futures import ThreadPoolExecutor

    from pegaflow.connector.extra_config import parse_config
    from pegaflow.connector.registrar import Registrar

    pool = ThreadPoolExecutor(1)
    registrar = Registrar(None, parse_config({"timeout_s": 5.0}), "i", 0, 1, pool)
    go = threading.Event()

    def load() -> tuple[bool, float]:
        go.wait(5)
        start = time.monotonic()
        return registrar.wait_registered(), time.monotonic() - start

    loading = pool.submit(load)
    registrar._attempt = pool.submit(lambda: None)  # queued behind the load
    go.set()
    registered, waited = loading.result(timeout=30)
    assert not registered and waited < 1.0
    pool.shutdown()


def test_an_attempt_running_at_close_leaves_no_registration(
    server_factory: Callable[..., ServerProc],
) -> None:
    """A re-registration runs on the worker's I/O pool, and shutdown does not
    wait for it. Before, one that was under way when the worker closed went
    on to open its session after close(): the server kept counting the
    closed engine as a live worker. Now the attempt ends the session itself
    and reports failure, and the server lets the registration go."""
    from concurrent.futures import ThreadPoolExecutor

    from pegaflow.client.pegaflow_client import PegaflowClient
    from pegaflow.connector.extra_config import parse_config
    from pegaflow.connector.registrar import Registrar
    from tests.kvbuf import LocalKV

    server = server_factory("--pool-size", "16mb")
    kv = LocalKV(layers=2, blocks=8)
    pool = ThreadPoolExecutor(1)
    client = PegaflowClient(server.addr, timeout_s=10)
    registrar = Registrar(client, parse_config({"timeout_s": 10.0}), "i", 0, 1, pool)
    registering, closed = threading.Event(), threading.Event()

    def register() -> object:
        reg = kv.register(client, "i", "m")
        registering.set()
        assert closed.wait(10), "the test never closed the registrar"
        return reg

    registrar._register_fn = register
    attempt = pool.submit(registrar.register_now)
    assert registering.wait(10)
    assert json.loads(server.get("/health")[1])["workers"] == 1
    registrar.close()
    closed.set()
    assert attempt.result(timeout=30) is False
    assert not registrar.registered and registrar._session is None
    deadline = time.monotonic() + 10
    while json.loads(server.get("/health")[1])["workers"] and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert json.loads(server.get("/health")[1])["workers"] == 0
    pool.shutdown()
    client.close()
