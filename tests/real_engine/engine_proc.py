"""A real vLLM engine (the CPU build) in a process of its own, driven by JSON
lines on stdin, one answer line on stdout (tests/real_engine/engine.py starts
it; benchmarks/real_engine_ttft.py too).

argv[1] is the engine's spec as JSON (engine.EngineSpec); the engine is built
as a user builds it: `vllm.LLM(...)` with `kv_transfer_config` as a dict.

Ops: generate(prompts, max_tokens) -> per prompt the greedy tokens, each
token's logprob, cached tokens and time to first token; metrics -> vLLM's
counters (its Prometheus registry: external prefix-cache hits, the
connector's `vllm:pegaflow_*`); reset_prefix_cache; exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def build(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "block_size": spec["block_size"],
        "enable_prefix_caching": True,
        "max_model_len": spec["max_model_len"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "max_num_seqs": spec["max_num_seqs"],
        "seed": 0,
        "disable_log_stats": False,  # vLLM's counters, the connector's too
        "enforce_eager": spec["enforce_eager"],
        "kv_cache_memory_bytes": spec["kv_cache_bytes"],
        **spec.get("engine_args", {}),
    }
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    return LLM(**kwargs)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False
    )
    start = time.monotonic()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    wall = time.monotonic() - start
    results = []
    for out in outs:
        comp = out.outputs[0]
        logprobs = [
            lp[tok].logprob
            for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True)
        ]
        m = out.metrics
        ttft = None
        if m is not None and getattr(m, "first_token_latency", None):
            ttft = m.first_token_latency
        results.append(
            {
                "tokens": list(comp.token_ids),
                "logprobs": logprobs,
                "cached": out.num_cached_tokens,
                "ttft": ttft,
            }
        )
    return {"outputs": results, "wall_s": wall}


def metrics(llm: Any) -> dict:
    """vLLM's counters by name (summed over labels: one engine here), read
    from the Prometheus registry its stat logger feeds: LLM.get_metrics()
    truncates counters to integers, and the `*_seconds` ones are fractions."""
    from prometheus_client import REGISTRY

    del llm  # the registry is this process's
    values: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.type != "counter" or not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                values[family.name] = values.get(family.name, 0.0) + sample.value
    return {"metrics": values}


def serve(llm: Any, out: Any) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "exit":
                print(json.dumps({"ok": True}), file=out, flush=True)
                return
            if op == "generate":
                reply = generate(llm, cmd["prompts"], cmd["max_tokens"])
            elif op == "metrics":
                reply = metrics(llm)
            elif op == "reset_prefix_cache":
                reply = {"ok": bool(llm.reset_prefix_cache())}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # the test sees it as a RuntimeError
            reply = {"error": type(exc).__name__, "message": traceback.format_exc()}
            print(f"engine: {op} failed:\n{reply['message']}", file=sys.stderr)
        print(json.dumps(reply), file=out, flush=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    # vLLM logs to stdout (and so do its engine-core and worker processes,
    # which inherit fd 1): answers go to a private copy of stdout, and fd 1
    # becomes stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    start = time.monotonic()
    llm = build(spec)
    ready = {"ready": True, "start_s": time.monotonic() - start}
    print(json.dumps(ready), file=out, flush=True)
    serve(llm, out)
    # vLLM's engine core and workers are separate processes: shut them down
    # rather than leave them to the interpreter's exit.
    del llm


if __name__ == "__main__":
    main()
