"""KV events for routers through vLLM's real Scheduler and its own ZMQ event
publisher (`kv_events_config`): engine B's connector announces, with the
server pool's medium, the blocks engine A saved, its own blocks with their
tokens, and removes A's blocks once the server evicted them."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.connector.conftest import needs_vllm
from tests.procs import EngineProc, ServerProc

needs_vllm()

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from tests.connector.engine import BLOCK, Engine, vllm_config  # noqa: E402

FAST = {"retry_interval_s": 0.2}
DEADLINE_S = 90.0  # the machine is shared: generous


class Subscriber:
    """A router's end of vLLM's ZMQ publisher: every KVEventBatch it sent."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.events: list[object] = []

    def drain(self) -> None:
        while self.sock.poll(20):
            _topic, _seq, payload = self.sock.recv_multipart()
            self.events.extend(self.decode(payload).events)

    def stored(self, medium: str) -> list[BlockStored]:
        return [
            e for e in self.events if isinstance(e, BlockStored) and e.medium == medium
        ]

    def removed(self, medium: str) -> set[object]:
        return {
            h
            for e in self.events
            if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes
        }

    def close(self) -> None:
        self.sock.close(linger=0)


def _with_events(config: object, endpoint: str) -> object:
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
    )
    return config


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[str, Subscriber]]:
    endpoint = f"ipc://{tmp_path}/kv-events"
    sub = Subscriber(endpoint)
    yield endpoint, sub
    sub.close()


def _until(engine: Engine, sub: Subscriber, what: Callable[[], bool]) -> None:
    """Step the engine (vLLM publishes connector events at each step) until
    the subscriber has seen `what`."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        engine.step()
        sub.drain()
        if what():
            return
        time.sleep(0.05)
    raise AssertionError("the router never saw it")


def _ext(hashes: list[bytes]) -> set[object]:
    return {maybe_convert_block_hash(h) for h in hashes}


def test_router_sees_other_engines_blocks_own_tokens_and_evictions(
    pega_server: Callable[..., ServerProc],
    tiny_model: Path,
    router: tuple[str, Subscriber],
    engines: Callable[[], EngineProc],
) -> None:
    """Scenario: a KV-aware router reads engine B's KV events. Engine A
    saved prompts before B started; B must announce them under the pool's
    medium (CPU), announce its own saved blocks with their tokens, and
    withdraw A's blocks once the server evicted them for other saves."""
    server = pega_server("--pool-size", "8mb")
    endpoint, sub = router
    rnd = random.Random(5)
    a = Engine(vllm_config(tiny_model, FAST))
    reqs_a = [
        a.add(f"a{i}", [rnd.randrange(50, 950) for _ in range(100)]) for i in range(3)
    ]
    a.run()
    a_hashes = [h for r in reqs_a for h in r.block_hashes[: 99 // BLOCK]]
    assert a.counters()["save_blocks"] >= len(a_hashes)

    b = Engine(_with_events(vllm_config(tiny_model, FAST), endpoint))
    try:
        pool = lambda: {h for e in sub.stored("CPU") for h in e.block_hashes}  # noqa: E731
        _until(b, sub, lambda: _ext(a_hashes) <= pool())
        others = [e for e in sub.stored("CPU") if _ext(a_hashes) & set(e.block_hashes)]
        assert all(e.token_ids == [] and e.locality == "LOCAL" for e in others)
        assert all(e.group_idx == 0 for e in others)

        # B's own blocks come back from the server with their tokens.
        tokens = [rnd.randrange(50, 950) for _ in range(70)]
        own = b.add("b0", tokens)
        b.run()
        mine = _ext(own.block_hashes[: 69 // BLOCK])
        _until(b, sub, lambda: mine <= pool())
        chain = [e for e in sub.stored("CPU") if mine & set(e.block_hashes)]
        assert len(chain) == 1 and chain[0].block_size == BLOCK
        assert chain[0].token_ids == tokens[: len(mine) * BLOCK]
        assert chain[0].parent_block_hash is None  # the prompt's first block

        # Another namespace's saves fill the pool: the server evicts A's
        # blocks (the oldest) and B's router is told.
        filler = engines()
        filler.call("init", layout="LBNHC", layers=1, blocks=128, heads=1,
                    block_size=16, head=16, seed=3)  # fmt: skip
        filler.call("register", addr=server.addr, instance="filler", namespace="x")
        for _ in range(120):  # 12k blocks of 1 KiB: past the 8 MiB pool
            hashes = [secrets.token_hex(32) for _ in range(100)]
            filler.call("save", block_ids=list(range(100)), hashes=hashes)
        _until(b, sub, lambda: _ext(a_hashes) <= sub.removed("CPU"))
        # Each block stored once, removed once: no double announcements.
        stored = [h for e in sub.stored("CPU") for h in e.block_hashes]
        assert len(stored) == len(set(stored))
    finally:
        a.close()
        b.close()


def test_blocks_on_the_ssd_tier_are_announced_under_storage(
    pega_server: Callable[..., ServerProc],
    tiny_model: Path,
    router: tuple[str, Subscriber],
    tmp_path: Path,
) -> None:
    """Scenario: the server writes every sealed block to its SSD tier too.
    Engine B's router must see engine A's blocks under both mediums: the
    pool's (CPU) and the SSD's (STORAGE, locality LOCAL), each once."""
    pega_server(
        *("--pool-size", "8mb", "--ssd-cache-path", str(tmp_path / "ssd0.bin")),
        *("--ssd-cache-capacity", "32mb", "--ssd-backend", "posix"),
        *("--ssd-write-on", "seal"),
    )
    endpoint, sub = router
    rnd = random.Random(7)
    a = Engine(vllm_config(tiny_model, FAST))
    reqs = [
        a.add(f"a{i}", [rnd.randrange(50, 950) for _ in range(100)]) for i in range(2)
    ]
    a.run()
    a_hashes = _ext([h for r in reqs for h in r.block_hashes[: 99 // BLOCK]])
    b = Engine(_with_events(vllm_config(tiny_model, FAST), endpoint))
    try:
        held = lambda m: {h for e in sub.stored(m) for h in e.block_hashes}  # noqa: E731
        _until(b, sub, lambda: a_hashes <= held("CPU") and a_hashes <= held("STORAGE"))
        on_ssd = [e for e in sub.stored("STORAGE") if a_hashes & set(e.block_hashes)]
        assert all(e.locality == "LOCAL" and e.token_ids == [] for e in on_ssd)
        stored = [h for e in sub.stored("STORAGE") for h in e.block_hashes]
        assert len(stored) == len(set(stored))
    finally:
        a.close()
        b.close()


def test_after_a_server_restart_the_router_is_told_what_went(
    pega_server: Callable[..., ServerProc],
    tiny_model: Path,
    router: tuple[str, Subscriber],
) -> None:
    """Scenario: the server restarts without a pool file, so every block B's
    router was told of is gone. B's connector reconnects on its own, diffs
    the new server's (empty) snapshot against what it published and removes
    them all; blocks saved after are announced."""
    server = pega_server()
    endpoint, sub = router
    rnd = random.Random(9)
    tokens = [rnd.randrange(50, 950) for _ in range(100)]
    b = Engine(_with_events(vllm_config(tiny_model, FAST), endpoint))
    try:
        req = b.add("b0", tokens)
        b.run()
        mine = _ext(req.block_hashes[: 99 // BLOCK])
        pool = lambda: [h for e in sub.stored("CPU") for h in e.block_hashes]  # noqa: E731
        _until(b, sub, lambda: mine <= set(pool()))
        server.stop()
        pega_server()  # same port, empty pool
        _until(b, sub, lambda: mine <= sub.removed("CPU"))
        # Its workers re-registered: what it saves now is announced.
        again = b.add("b1", [rnd.randrange(50, 950) for _ in range(100)])
        b.run()
        _until(b, sub, lambda: _ext(again.block_hashes[:6]) <= set(pool()))
    finally:
        b.close()
