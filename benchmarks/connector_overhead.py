"""PegaKVConnector inside vLLM 0.33's real Scheduler on CPU (no model):

1. overhead per scheduler step with N requests decoding (schedule() +
   update_from_output(), with the connector vs without), and the worker
   connector's calls per step;
2. cost of one prefix query (get_num_new_matched_tokens) for a 1024-token prompt,
   miss and hit;
3. two engines: A serves prompts, B serves the same ones and ones sharing 3/4 of
   their prefix: hit-token rate and bytes moved.

    python benchmarks/connector_overhead.py [--steps 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.connector.conftest import free_port  # noqa: E402
from tests.procs import start_server  # noqa: E402


def tokens(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(50, 950) for _ in range(n)]


def step_overhead(model: Path, n: int, steps: int, connector: bool) -> dict:
    from tests.connector.engine import Engine, vllm_config

    config = vllm_config(
        model,
        max_len=1024,
        connector=connector,
        max_num_seqs=max(16, n),
        max_num_batched_tokens=8192,
    )
    blocks = max(n * (steps // 16 + 8), 64) + 16  # room for max_len 1024
    engine = Engine(config, num_blocks=blocks, write_kv=False)
    rnd = random.Random(n)
    for i in range(n):
        engine.add(f"d{i}", tokens(rnd, 64), max_tokens=steps + 64)
    while len(engine.sched.running) < n or any(
        r.num_output_tokens == 0 for r in engine.sched.running
    ):
        engine.step()  # prefill done: every request decodes from here
    spent = [0.0]
    if connector:
        time_hooks(engine.sched.connector, spent)
    mark = len(engine.timing)
    hooks = []
    for _ in range(steps):
        before = spent[0]
        engine.step()
        hooks.append(spent[0] - before)
    sched = [t[0] for t in engine.timing[mark:]]
    worker = [t[1] for t in engine.timing[mark:]]
    engine.close()
    return {
        "sched_us": 1e6 * statistics.median(sched),
        "hooks_us": 1e6 * statistics.mean(hooks),
        "worker_us": 1e6 * statistics.median(worker),
    }


HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "get_kv_connector_stats",
    "take_events",
    "has_pending_push_work",
)


def time_hooks(conn: object, spent: list[float]) -> None:
    """Wrap the scheduler connector's hooks: time spent inside them is exactly
    what the connector adds to the scheduler step (the A/B difference of whole
    steps is below this machine's step-to-step noise)."""
    for name in HOOKS:
        fn = getattr(conn, name)

        def timed(*args: object, _fn: object = fn, **kw: object) -> object:
            start = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(conn, name, timed)


def query_cost(model: Path, reps: int) -> dict:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from tests.connector.engine import Engine, vllm_config

    rnd = random.Random(5)
    prompts = [tokens(rnd, 1024) for _ in range(reps)]
    a = Engine(vllm_config(model, max_len=2048), num_blocks=reps * 66, write_kv=False)
    for i, p in enumerate(prompts):
        a.add(f"a{i}", p, max_tokens=1)
    a.run()
    b = Engine(vllm_config(model, max_len=2048), num_blocks=256, write_kv=False)
    b.step()  # idle: the worker hands the scheduler the server's query socket
    conn = b.sched.connector
    out = {}
    for case, batch in (
        ("miss", [tokens(rnd, 1024) for _ in range(reps)]),
        ("hit", prompts),
    ):
        times, hits = [], 0
        for i, p in enumerate(batch):
            req = Request(
                f"{case}{i}",
                p,
                SamplingParams(max_tokens=1),
                None,
                block_hasher=b.hasher,
            )
            start = time.perf_counter()
            n, _ = conn.get_num_new_matched_tokens(req, 0)
            times.append(time.perf_counter() - start)
            hits += n
            conn.request_finished(req, [])  # releases the lease
        out[f"{case}_us"] = 1e6 * statistics.median(times)
        out[f"{case}_tokens"] = hits / len(batch)
    a.close()
    b.close()
    return out


def two_engines(model: Path, n: int) -> dict:
    from tests.connector.engine import Engine, vllm_config

    rnd = random.Random(9)
    prompts = {f"p{i}": tokens(rnd, 1024) for i in range(n)}
    related = {
        f"q{i}": p[:768] + tokens(rnd, 256) for i, p in enumerate(prompts.values())
    }
    cfg = {"retry_interval_s": 0.2}
    a = Engine(vllm_config(model, cfg, max_len=2048), num_blocks=n * 70)
    for rid, p in prompts.items():
        a.add(rid, p, max_tokens=2)
    a.run()
    result = {"blocks_per_rank": a.worker._worker.registrar.slot_bytes}
    saved = a.counters()
    result["A_save_MB"] = saved["save_bytes"] / 1e6
    for name, batch in (("same", prompts), ("shared_3/4", related)):
        b = Engine(vllm_config(model, cfg, max_len=2048), num_blocks=n * 70)
        for rid, p in batch.items():
            b.add(rid, p, max_tokens=2)
        start = time.perf_counter()
        b.run()
        c = b.counters()
        assert b.errors == [], b.errors[:3]
        result[name] = {
            "prompt_tokens": sum(map(len, batch.values())),
            "hit_tokens": c["hit_tokens"],
            "hit_rate": c["hit_tokens"] / sum(map(len, batch.values())),
            "load_MB": c["load_bytes"] / 1e6,
            "load_GBps": c["load_bytes"] / 1e9 / max(c["load_seconds"], 1e-9),
            "wall_s": time.perf_counter() - start,
        }
        b.close()
    a.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--engines-prompts", type=int, default=16)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/connector.json"
    )
    args = parser.parse_args()
    from tests.connector.engine import model_dir

    tmp = Path(tempfile.mkdtemp(prefix="pegaflow-bench-"))
    port = free_port()
    import os

    os.environ["PEGAFLOW_HOST"] = "http://127.0.0.1"
    os.environ["PEGAFLOW_PORT"] = str(port)
    server = start_server(
        tmp,
        "--pool-size",
        "2gb",
        "--addr",
        f"127.0.0.1:{port}",
        "--log-level",
        "warning",
    )
    try:
        model = model_dir(tmp)
        rows = []
        for n in (1, 64, 256):
            base = step_overhead(model, n, args.steps, connector=False)
            with_conn = step_overhead(model, n, args.steps, connector=True)
            rows.append(
                {
                    "requests": n,
                    "sched_us_without": round(base["sched_us"], 1),
                    "sched_us_with": round(with_conn["sched_us"], 1),
                    "added_us": round(with_conn["sched_us"] - base["sched_us"], 1),
                    "hooks_us": round(with_conn["hooks_us"], 1),
                    "worker_us": round(with_conn["worker_us"], 1),
                }
            )
        query = query_cost(model, args.queries)
        engines = two_engines(
            model_dir(tmp, layers=32, kv_heads=8), args.engines_prompts
        )
    finally:
        server.stop()
    print(
        "| running requests | step µs, no connector | step µs, with | difference "
        "| µs in scheduler hooks | µs in worker hooks |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['requests']} | {r['sched_us_without']} | {r['sched_us_with']} | "
            f"{r['added_us']} | {r['hooks_us']} | {r['worker_us']} |"
        )
    print(
        f"\nquery, 1024-token prompt: miss {query['miss_us']:.0f} µs, "
        f"hit {query['hit_us']:.0f} µs ({query['hit_tokens']:.0f} tokens)"
    )
    for name in ("same", "shared_3/4"):
        e = engines[name]
        print(
            f"two engines, {name}: hit rate {e['hit_rate']:.3f} "
            f"({e['hit_tokens']:.0f}/{e['prompt_tokens']} tokens), "
            f"loaded {e['load_MB']:.1f} MB at {e['load_GBps']:.2f} GB/s"
        )
    print(f"A saved {engines['A_save_MB']:.1f} MB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.node(),
                "python": platform.python_version(),
                "date": time.strftime("%Y-%m-%d"),
                "steps": args.steps,
                "step_overhead": rows,
                "query": query,
                "two_engines": engines,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
