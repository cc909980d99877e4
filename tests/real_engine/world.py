"""One model's world for the real-engine cases: a pegaflow server on a pool
file, a no-connector control engine, engine A (saves) and engine B (hits),
each a real vLLM process, started together and reused across the cases.

Reuse is honest here: B clears vLLM's own prefix cache before each case, so
whatever it does not compute comes from the server (the counters say so), and
each case compares counter deltas, never totals.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tests.procs import ServerProc, start_server
from tests.real_engine.cases import (
    MAX_TOKENS,
    Case,
    first_block_changed,
    prompts,
    saved_blocks,
)
from tests.real_engine.engine import (
    EngineSpec,
    Output,
    RealEngine,
    pega_transfer_config,
    start_engines,
)

# A changed first block must move the output by this many times the case's
# logprob tolerance, so outputs equal within the tolerance mean the loaded
# first block was right. (Seen: the Llama moves its tokens; a Qwen3-Next with
# one full-attention layer of four moved its logprobs by 0.031 only.)
SENSITIVITY = 10
POLL_S = 0.05
LOADED_HOST_DEADLINES = {"timeout_s": 30.0, "query_timeout_s": 30.0}


def assert_same(got: list[Output], want: list[Output], what: str, tol: float) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tokens == w.tokens, f"{what}: prompt {i} decoded other tokens"
        worst = max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True))
        assert worst <= tol, f"{what}: prompt {i} logprobs differ by {worst}"


def moved(a: Output, b: Output) -> float:
    """How far two outputs are apart: inf when the tokens differ."""
    if a.tokens != b.tokens:
        return math.inf
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))


def wait_for(what: str, done: object, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f} s: {what}"
        time.sleep(POLL_S)


@dataclass
class World:
    case: Case
    root: Path
    shm: Path
    port: int
    server: ServerProc | None = None
    engines: dict[str, RealEngine] = field(default_factory=dict)
    batch: list[list[int]] = field(default_factory=list)
    control: list[Output] = field(default_factory=list)
    variant: Output | None = None  # control's output with the first block changed
    a_saved: bool = False

    # -- the server ---------------------------------------------------------
    def server_flags(self) -> list[str]:
        return ["--pool-size", "256mb", "--pool-file", str(self.shm / "pool.bin")]

    def start_server(self) -> ServerProc:
        self.server = start_server(
            self.root, *self.server_flags(), "--addr", f"127.0.0.1:{self.port}"
        )
        return self.server

    def live_server(self) -> ServerProc:
        if self.server is None or self.server.proc.poll() is not None:
            self.start_server()
        assert self.server is not None
        return self.server

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.stop(signal.SIGKILL)

    def stats(self) -> dict:
        status, body = self.live_server().get("/stats")
        assert status == 200, body
        return json.loads(body)

    def health(self) -> dict:
        return json.loads(self.live_server().get("/health")[1])

    def loaded_blocks(self) -> float:
        return self.live_server().metric(
            "pegaflow_transfer_blocks_total", 'direction="load"'
        )

    # -- the engines --------------------------------------------------------
    def spec(self, model: Path, **kwargs: object) -> EngineSpec:
        base = EngineSpec(
            model=str(model),
            enforce_eager=self.case.enforce_eager,
            engine_args={"dtype": self.case.dtype, **self.case.engine_args},
        )
        return replace(base, **kwargs)

    def launch(self) -> None:
        """Write the model, start the server and spawn the engines; returns
        while the engines import and load (start() waits for them), so the
        suite launches the next model's world while this one's cases run."""
        model = self.case.build(self.root / "models")
        self.start_server()
        env = {
            "PEGAFLOW_HOST": "http://127.0.0.1",
            "PEGAFLOW_PORT": str(self.port),
            **self.case.env,
        }
        # A: vLLM's defaults (load failures fail the request). B: the policy
        # docs/vllm.md recommends for a best-effort cache, and the fault hook
        # for the mid-load case (armed only when its trigger file is written).
        # Both with deadlines for a loaded 2-core host (the next model's
        # engines start beside these cases): a save past the default 10 s is
        # lost for good (the worker re-registers; vLLM saves a block once), a
        # query past 1 s is a miss, and on the dev VM a file write (vLLM's own
        # logs, the engines' compile caches) can wait 12-33 s on a disk whose
        # journal waits for discards. The checks stay what they are.
        extra = {"kv_connector_extra_config": LOADED_HOST_DEADLINES}
        specs = {
            "control": self.spec(model),
            "a": self.spec(model, kv_transfer_config=pega_transfer_config(**extra)),
            "b": self.spec(
                model,
                kv_transfer_config=pega_transfer_config(
                    kv_load_failure_policy="recompute", **extra
                ),
            ),
        }
        for name, spec in specs.items():
            trigger = self.trigger if name == "b" else None
            log = self.root / f"engine-{name}.log"
            self.engines[name] = RealEngine(spec, log, env, kill_trigger=trigger)

    def start(self) -> None:
        """Launched (or launch now), the engines ready, and the control's
        outputs taken: the control then exits."""
        if not self.engines:
            self.launch()
        start_engines(*self.engines.values())
        self.batch = prompts(self.case)
        variant = first_block_changed(self.batch[0], self.case.block)
        outs = self.engines["control"].generate([*self.batch, variant], MAX_TOKENS)
        self.control, self.variant = outs[:-1], outs[-1]
        self.engines.pop("control").close()  # its CPU is the others' now

    @property
    def trigger(self) -> Path:
        return self.root / "kill-on-load"

    def a_saves(self) -> None:
        """Engine A serves the batch (misses: it computes and saves), and A's
        saves land on the server; A exits."""
        if self.a_saved:
            return
        a = self.engines["a"]
        outs = a.generate(self.batch, MAX_TOKENS)
        assert_same(outs, self.control, "engine A", self.case.logprob_tol)
        want = saved_blocks(self.case, self.batch)
        wait_for(
            f"{want} blocks of A's saves resident on the server",
            lambda: self.stats()["pool"]["resident_blocks"] >= want,
        )
        self.engines.pop("a").close()
        self.a_saved = True

    def b_ready(self) -> RealEngine:
        """Engine B with vLLM's prefix cache empty and registered with the
        (possibly restarted) server: an idle engine takes no steps, and its
        worker re-registers from a step, so B serves a one-token prompt (no
        full block: no query, no save) until the server counts every part of
        it (a hybrid model's groups re-register one by one, and a query for
        a part not yet back is a miss for the whole prefix)."""
        b = self.engines["b"]
        b.reset_prefix_cache()
        wait_for(
            "engine B registered with the server",
            lambda: (
                b.generate([[1, 2, 3]], 1)
                and self.health()["workers"] >= self.case.registrations
            ),
        )
        return b

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
        if self.server is not None:
            self.server.stop()
