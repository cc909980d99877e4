"""One TP rank of a vLLM engine without vLLM: KV tensors laid out as vLLM 0.33
lays them out (on the CPU or a GPU), the connector's WorkerHalf, and connector
plans given by the test. Run by tests/connector/ranks.py, one JSON command per
line on stdin, one JSON answer per line on stdout.

vLLM is not importable on the GPU test machine: the worker half needs from
`vllm_config` only what `tensors.namespace_parts` reads, built here.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from pegaflow.connector.extra_config import ConnectorConfig
from pegaflow.connector.kv_groups import GroupRule, KVGroups
from pegaflow.connector.step_plan import LoadJob, SaveJob, StepPlan
from pegaflow.connector.worker import WorkerHalf

state: dict[str, Any] = {}


def stand_in_config(block_size: int, tp_size: int, mla: bool) -> SimpleNamespace:
    """The fields of VllmConfig the worker half reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model="tiny-mla" if mla else "tiny-llama",
            revision=None,
            dtype=torch.bfloat16,
            use_mla=mla,
        ),
        cache_config=SimpleNamespace(
            cache_dtype="auto", block_size=block_size, prefix_caching_hash_algo="sha256"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
    )


def kv_views(
    device: str,
    mla: bool,
    layout: str,
    layers: int,
    blocks: int,
    block_size: int,
    heads: int,
) -> dict[str, torch.Tensor]:
    """vLLM 0.33: one int8 buffer; per layer [blocks, heads, block_size, 2 * head]
    physically LBNHC (layer-major) or BLNHC (block-major), or [blocks,
    block_size, 576] for MLA; bf16, head 64."""
    shape = (block_size, 576) if mla else (block_size, heads, 2 * 64)
    page = 2 * int(torch.tensor(shape).prod())
    buf = torch.zeros(layers * blocks * page, dtype=torch.int8, device=device)
    if layout == "BLNHC":
        phys = buf.view(torch.bfloat16).view(blocks, layers, *shape).transpose(0, 1)
    elif layout == "LBNHC":
        phys = buf.view(torch.bfloat16).view(layers, blocks, *shape)
    else:
        raise ValueError(f"layout {layout!r}")
    views = [phys[i] if mla else phys[i].permute(0, 2, 1, 3) for i in range(layers)]
    state["buffer"] = buf  # the allocation the views share
    return {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}


STATE_BYTES = 20480  # a Mamba layer's state page: not an attention page's size


def hybrid_views(device: str, layers: int, blocks: int, block_size: int, heads: int):
    """vLLM 0.33's layout of a hybrid model: attention layers (a sliding-window
    group) and Mamba state layers ([blocks, 1, 1, state bytes] int8, one page
    per block) as views into one int8 allocation."""
    page = 2 * block_size * heads * 2 * 64
    attn = layers - 1
    buf = torch.zeros(blocks * (attn * page + STATE_BYTES), dtype=torch.int8)
    buf = buf.to(device)
    phys = buf[: attn * blocks * page].view(torch.bfloat16)
    phys = phys.view(attn, blocks, block_size, heads, 2 * 64)
    views = {
        f"model.layers.{i}.self_attn.attn": phys[i].permute(0, 2, 1, 3)
        for i in range(attn)
    }
    tail = buf[attn * blocks * page :].view(blocks, 1, 1, STATE_BYTES)
    views[f"model.layers.{attn}.mixer"] = tail
    state["buffer"] = buf
    return views


def hybrid_groups(names: list[str], block_size: int) -> KVGroups:
    window = GroupRule(0, "sliding", block_size, 31, tuple(names[:-1]))
    mamba = GroupRule(1, "mamba", block_size, 0, tuple(names[-1:]))
    return KVGroups((window, mamba), block_size, block_size)


def init(
    addr: str,
    instance: str,
    tp_rank: int,
    tp_size: int,
    mla: bool,
    device: str = "cpu",
    layout: str = "LBNHC",
    layers: int = 4,
    blocks: int = 64,
    block_size: int = 16,
    heads: int = 2,
    hybrid: bool = False,
) -> dict:
    shutdown()
    groups = None
    if hybrid:
        caches = hybrid_views(device, layers, blocks, block_size, heads)
        groups = hybrid_groups(list(caches), block_size)
    else:
        caches = kv_views(device, mla, layout, layers, blocks, block_size, heads)
    config = ConnectorConfig(addr=addr, timeout_s=20.0, retry_interval_s=0.2)
    worker = WorkerHalf(config, instance, tp_rank, tp_size, groups=groups)
    worker.register(caches, blocks, stand_in_config(block_size, tp_size, mla))
    state.update(worker=worker, caches=caches, device=device)
    reg = worker.registrar
    return {
        "registered": reg.registered,
        "namespace": reg.namespace,
        "replicated": reg.replicated,
        "slot_bytes": reg.slot_bytes,
        "parts": {
            part.instance_id: [part.registered, part.namespace, part.slot_bytes]
            for part in worker.parts.values()
        },
    }


def write(block_ids: list[int], seed: int) -> dict:
    """Seeded random bytes into these blocks of every layer (the forward)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(block_ids, device=state["device"])
    for view in state["caches"].values():  # a test's fake forward: per layer
        raw = view.view(torch.int16)
        vals = torch.randint(-(1 << 15), 1 << 15, raw[ids].shape, generator=gen)
        raw[ids] = vals.to(raw.dtype).to(state["device"])
    return {"ok": True}


def digest(block_ids: list[int], layers: list[str] | None = None) -> dict:
    """sha256 of each block's pages, every layer (or these layers)."""
    caches = state["caches"]
    views = [caches[n] for n in (layers or caches)]
    out = []
    for b in block_ids:
        h = hashlib.sha256()
        for v in views:
            h.update(v[b].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        out.append(h.hexdigest())
    return {"digests": out}


def step(loads: list[dict], saves: list[dict], timeout: float = 30.0) -> dict:
    """One engine step as vLLM's model runner drives the connector, then wait
    until its loads and saves ended. Returns what the connector reported."""
    w: WorkerHalf = state["worker"]
    plan = StepPlan(
        loads=[
            LoadJob(
                j["req_id"],
                j["lease_id"],
                j["block_ids"],
                j["sync"],
                j.get("group", 0),
                j.get("lease_offset", 0),
            )
            for j in loads
        ],
        saves=[
            SaveJob(
                j["req_id"],
                j["block_ids"],
                [bytes.fromhex(h) for h in j["hashes"]],
                j.get("group", 0),
            )
            for j in saves
        ],
    )
    w.handle_preemptions(plan)
    w.start_load(plan, layer_waits=True)
    w.wait_sync_loads()  # the first layer's wait_for_layer_load
    errors_after_sync = sorted(w.take_load_errors())
    w.save(plan)
    recving: set[str] = set()
    failed: set[str] = set()  # hybrid: failed loads are reported per request
    saves_done: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while (w._recving or w._saves) and time.monotonic() < deadline:
        time.sleep(0.005)
        recving |= w.get_finished()[1]
        failed |= w.take_failed_requests()
        report = w.take_report()
        if report is not None:
            for rid, n in report.saves_done.items():
                saves_done[rid] = saves_done.get(rid, 0) + n
    return {
        "recving": sorted(recving),
        "failed": sorted(failed),
        "saves_done": saves_done,
        "sync_errors": errors_after_sync,
        "errors": sorted(w.take_load_errors()),
        "stats": w.take_stats() or {},
        "pending": bool(w._recving or w._saves),
    }


def shutdown() -> dict:
    worker = state.pop("worker", None)
    if worker is not None:
        worker.shutdown()
    return {"ok": True}


OPS = {"init": init, "write": write, "digest": digest, "step": step}


def main() -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            shutdown()
            print(json.dumps({"ok": True}), flush=True)
            return
        try:
            reply = OPS[op](**cmd)
        except Exception as exc:  # report to the test, keep serving
            traceback.print_exc(file=sys.stderr)
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
