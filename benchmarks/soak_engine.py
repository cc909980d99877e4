"""One engine process of benchmarks/soak.py (started with 'spawn').

It holds host KV memory (numpy, no torch), registers it with the server and
loops: query a prompt's chained block hashes, load the hit prefix into OTHER
block ids (poisoned first) and check every byte, then save the rest. A block's
bytes derive from its hash alone, so any engine verifies what any engine saved.

Everything it counts lives in shared memory the soak owns, updated in place: a
SIGKILL loses at most the operation in flight. Which failures are expected is
decided here, from the fault generations the soak bumps (see soak.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pegaflow.client.kv_layouts import describe, vllm_layer_views
from pegaflow.client.pegaflow_client import PegaflowClient, Session
from pegaflow.common.errors import PegaflowError, ServerUnavailable, UnknownInstance

logger = logging.getLogger("soak.engine")

LAYERS = 4
PAGE = 4096  # bytes of one layer of one block
SLOT = LAYERS * PAGE
HASH_LEN = 32
POISON = 0xA5  # what a load's destination holds before the load
RETRY_S = 0.2  # between registration attempts while the server is away

COUNTERS = (
    "iterations",
    "queries",
    "hit_blocks",
    "loads",
    "saves",
    "stored_blocks",
    "deduplicated_blocks",
    "rejected_blocks",
    "registrations",
    "register_failures",
    "verified_blocks",
    "verified_bytes",
    "wrong_blocks",
    "lost_blocks",
    "lost_loads",
    "expected_failures",
    "unexpected_query_failures",
    "unexpected_save_failures",
    "unexpected_register_failures",
)
C = {name: i for i, name in enumerate(COUNTERS)}

# Query latency histogram: bucket i holds [R**i, R**(i+1)) microseconds.
BUCKETS = 1000
RATIO = 1.02
PHASES = ("plain", "burn")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    addr: str
    namespace: str
    prompts: int
    blocks_per_prompt: int
    engine_blocks: int
    timeout_s: float
    seed: int
    log_dir: str


@dataclass(frozen=True, slots=True)
class Shared:
    """Shared memory of the soak; only the soak writes gens, phase and stop.
    gens[0]: the server's fault generation, gens[1 + slot]: that engine's; odd
    while a fault is in progress."""

    counters: Any  # RawArray int64 [engines * len(COUNTERS)]
    hist: Any  # RawArray int64 [engines * len(PHASES) * BUCKETS]
    gens: Any  # RawArray int64 [1 + engines]
    phase: Any  # RawValue int: index into PHASES
    go: Any  # RawValue int: 1 = start the loop (set once all registered)
    stop: Any  # RawValue int: 1 = finish the iteration and exit


def prompt_hashes(prompt: int, n: int) -> list[bytes]:
    """vLLM-style chained block hashes of one prompt."""
    h = hashlib.sha256(b"soak" + prompt.to_bytes(8, "little")).digest()
    out = [h]
    for j in range(1, n):
        h = hashlib.sha256(h + j.to_bytes(4, "little")).digest()
        out.append(h)
    return out


def block_bytes(block_hash: bytes) -> np.ndarray:
    """The SLOT bytes every engine saves under this hash (all layers)."""
    rng = np.random.default_rng(int.from_bytes(block_hash[:16], "little"))
    return np.frombuffer(rng.bytes(SLOT), np.uint8)


def bucket(seconds: float) -> int:
    us = max(seconds * 1e6, 1.0)
    return min(int(math.log(us) / math.log(RATIO)), BUCKETS - 1)


def bucket_seconds(i: int) -> float:
    """Middle of bucket i, in seconds."""
    return RATIO ** (i + 0.5) / 1e6


class SoakEngine:
    def __init__(self, slot: int, spec: EngineSpec, shared: Shared) -> None:
        self.slot, self.spec, self.shared = slot, spec, shared
        self.buf = np.zeros(LAYERS * spec.engine_blocks * PAGE, np.uint8)
        self.views = vllm_layer_views(self.buf, LAYERS, spec.engine_blocks, (PAGE,))
        self.mem = describe(self.views)
        self.client = PegaflowClient(spec.addr, timeout_s=spec.timeout_s)
        self.instance = f"soak-{slot}-{os.getpid()}"
        self.session: Session | None = None
        self.registered = False
        self.synced = -1  # server generation of this engine's last success
        self.rng = np.random.default_rng([spec.seed, slot, os.getpid()])
        self.half = spec.engine_blocks // 2  # saves from [0, half), loads above
        self._base = slot * len(COUNTERS)

    # -- bookkeeping -----------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        self.shared.counters[self._base + C[name]] += n

    def window(self) -> tuple[int, int]:
        return self.shared.gens[0], self.shared.gens[1 + self.slot]

    def expected(self, start: tuple[int, int]) -> bool:
        """A failure is expected when a fault was in progress when the call
        started or began before it ended, or when this engine has had no
        success since the last server fault (it learns of a restart by
        failing)."""
        now = self.window()
        return (
            start[0] % 2 == 1
            or start[1] % 2 == 1
            or now != start
            or self.synced < start[0]
        )

    def succeeded(self, start: tuple[int, int]) -> None:
        if start[0] % 2 == 0:
            self.synced = max(self.synced, start[0])

    def failed(self, op: str, exc: PegaflowError, start: tuple[int, int]) -> None:
        if self.expected(start):
            self.count("expected_failures")
        else:
            self.count(f"unexpected_{op}_failures")
            logger.warning(
                "%s: %s failed outside any fault: %s", self.instance, op, exc
            )
        if isinstance(exc, ServerUnavailable | UnknownInstance):
            self.registered = False  # as connector/registrar.py: register again

    # -- registration -------------------------------------------------------------
    def register(self) -> bool:
        """Close the old session, register, open a new one (the registrar's
        order: a session ending after the new registration would drop it)."""
        start = self.window()
        if self.session is not None:
            self.session.close()
            self.session = None
        try:
            self.client.register_host(
                self.instance,
                self.spec.namespace,
                os.getpid(),
                self.mem.regions,
                self.mem.layers,
            )
            self.session = self.client.open_session(self.instance, interval_s=1.0)
        except PegaflowError as exc:
            self.count("register_failures")
            self.failed("register", exc, start)
            self.registered = False
            return False
        self.count("registrations")
        self.registered = True
        self.succeeded(start)
        return True

    # -- one iteration ------------------------------------------------------------
    def step(self) -> None:
        n_blocks = self.spec.blocks_per_prompt
        hashes = prompt_hashes(int(self.rng.integers(self.spec.prompts)), n_blocks)
        phase = self.shared.phase.value
        start = self.window()
        t = time.perf_counter()
        try:
            res = self.client.query(self.instance, hashes, hash_len=HASH_LEN)
        except PegaflowError as exc:
            self.failed("query", exc, start)
            return
        seconds = time.perf_counter() - t
        self.count("queries")
        if not self.expected(start):  # latency of undisturbed queries only
            i = (self.slot * len(PHASES) + phase) * BUCKETS + bucket(seconds)
            self.shared.hist[i] += 1
        self.succeeded(start)
        hit = 0 if res.loading else res.num_blocks
        self.count("hit_blocks", hit)
        if hit:
            self.load(res.lease_id, hashes[:hit], start)
        if hit < n_blocks:
            self.save(hashes[hit:])
        self.count("iterations")

    def load(self, lease_id: int, hashes: list[bytes], start: tuple[int, int]) -> None:
        """start: the query's window: the lease dates from then."""
        dst = self.half + self.rng.choice(
            self.spec.engine_blocks - self.half, len(hashes), replace=False
        )
        for view in self.views:
            view[dst] = POISON
        self.count("loads")
        try:
            res = self.client.load(self.instance, lease_id, dst)
        except PegaflowError as exc:
            self.lost(hashes, start, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, ServerUnavailable | UnknownInstance):
                self.registered = False
            return
        if res.loaded != len(hashes):
            self.lost(hashes, start, f"loaded {res.loaded} of {len(hashes)}")
        for b, h in zip(dst[: res.loaded].tolist(), hashes, strict=False):
            got = np.concatenate([view[b] for view in self.views])
            if np.array_equal(got, block_bytes(h)):
                self.count("verified_blocks")
                self.count("verified_bytes", SLOT)
            else:
                self.count("wrong_blocks")
                logger.error(
                    "%s: WRONG bytes for %s in block %d (%d of %d bytes differ)",
                    self.instance,
                    h.hex(),
                    b,
                    int(np.count_nonzero(got != block_bytes(h))),
                    SLOT,
                )

    def lost(self, hashes: list[bytes], start: tuple[int, int], why: str) -> None:
        if self.expected(start):
            self.count("expected_failures")
            return
        self.count("lost_loads")
        self.count("lost_blocks", len(hashes))
        logger.error(
            "%s: LOST %d hit blocks (first %s): %s",
            self.instance,
            len(hashes),
            hashes[0].hex(),
            why,
        )

    def save(self, hashes: list[bytes]) -> None:
        src = self.rng.choice(self.half, len(hashes), replace=False)
        for b, h in zip(src.tolist(), hashes, strict=True):
            data = block_bytes(h)
            for layer, view in enumerate(self.views):
                view[b] = data[layer * PAGE : (layer + 1) * PAGE]
        start = self.window()
        self.count("saves")
        try:
            res = self.client.save(self.instance, src, hashes)
        except PegaflowError as exc:
            self.failed("save", exc, start)
            return
        self.succeeded(start)
        self.count("stored_blocks", res.stored)
        self.count("deduplicated_blocks", res.deduplicated)
        self.count("rejected_blocks", res.rejected)

    def run(self) -> None:
        while not self.shared.go.value and not self.shared.stop.value:
            if not self.registered:  # registered before the clock starts
                self.register()
            time.sleep(0.05)  # the soak starts every engine's loop at once
        while not self.shared.stop.value:
            if self.registered and self.session is not None and not self.session.alive:
                self.registered = False  # the server ended our session
            if not self.registered and not self.register():
                time.sleep(RETRY_S)  # the server is away: try again shortly
                continue
            self.step()
        if self.session is not None:
            self.session.close()
        self.client.close()


def main(slot: int, spec: EngineSpec, shared: Shared) -> None:
    """Process entry point."""
    logging.basicConfig(
        filename=str(Path(spec.log_dir) / f"engine-{slot}-{os.getpid()}.log"),
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    SoakEngine(slot, spec, shared).run()
