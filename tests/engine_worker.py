"""A scripted engine process holding torch CPU KV tensors (run by tests/procs.py).

Reads one JSON command per line on stdin and answers one JSON line on stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback

import torch

from pegaflow.client import PegaflowClient
from pegaflow.kv_layouts import describe

state: dict[str, object] = {}


def init(
    layout: str,
    layers: int,
    blocks: int,
    heads: int,
    block_size: int,
    head: int,
    seed: int,
    dtype: str = "bfloat16",
) -> dict:
    dt = getattr(torch, dtype)
    item = torch.empty((), dtype=dt).element_size()
    gen = torch.Generator().manual_seed(seed)
    if (
        layout == "kv_first"
    ):  # older vLLM: per layer [2, blocks, block_size, heads, head]
        tensors = [
            torch.empty(2, blocks, block_size, heads, head, dtype=dt)
            for _ in range(layers)
        ]
        for t in tensors:
            t.view(torch.int16 if item == 2 else torch.int8).copy_(
                torch.randint(
                    -(1 << 15) if item == 2 else -128,
                    (1 << 15) if item == 2 else 128,
                    t.shape,
                    generator=gen,
                )
            )
        kv_first = True
    else:  # vLLM 0.33: one int8 buffer, per-layer [blocks, heads, block_size, 2*head]
        page = heads * block_size * 2 * head * item
        buf = torch.randint(
            -128, 128, (layers * blocks * page,), dtype=torch.int8, generator=gen
        )
        if layout == "LBNHC":
            phys = buf.view(dt).view(layers, blocks, block_size, heads, 2 * head)
            tensors = [phys[i].permute(0, 2, 1, 3) for i in range(layers)]
        elif layout == "BLNHC":
            phys = buf.view(dt).view(blocks, layers, block_size, heads, 2 * head)
            tensors = [phys[:, i].permute(0, 2, 1, 3) for i in range(layers)]
        else:
            raise ValueError(f"layout {layout}")
        state["buffer"] = buf
        kv_first = False
    state["tensors"] = tensors
    state["mem"] = describe(tensors, kv_first=kv_first)
    return {"regions": len(state["mem"].regions)}


def _pages(block: int) -> bytes:
    """All bytes of one block, every layer, in the server's slot order."""
    out = []
    mem = state["mem"]
    for layer in mem.layers:
        base, _ = mem.regions[layer.region_index]
        for seg in layer.segments:
            start = layer.offset + block * layer.block_stride + seg.offset
            region = state.get("buffer")
            if region is None:
                region = _region_bytes(layer.region_index)
            out.append(
                bytes(region.view(torch.uint8)[start : start + seg.size].numpy())
            )
    return b"".join(out)


def _region_bytes(index: int) -> torch.Tensor:
    tensors = [t for t in state["tensors"]]
    return tensors[index].view(-1).view(torch.uint8) if index < len(tensors) else None


def digest(block_ids: list[int]) -> dict:
    return {"digests": [hashlib.sha256(_pages(b)).hexdigest() for b in block_ids]}


def register(
    addr: str,
    instance: str,
    namespace: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    session: bool = True,
) -> dict:
    client = PegaflowClient(addr)
    mem = state["mem"]
    reg = client.register_host(
        instance,
        namespace,
        os.getpid(),
        mem.regions,
        mem.layers,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    state.update(client=client, instance=instance, rank=tp_rank)
    if session:
        state["session"] = client.open_session(instance, tp_rank, interval_s=1.0)
    return {"slot_bytes": reg.slot_bytes, "server_pid": reg.server_pid}


def save(block_ids: list[int], hashes: list[str]) -> dict:
    res = state["client"].save(
        state["instance"],
        block_ids,
        [bytes.fromhex(h) for h in hashes],
        tp_rank=state["rank"],
    )
    return {
        "stored": res.stored,
        "deduplicated": res.deduplicated,
        "rejected": res.rejected,
    }


def query(hashes: list[str]) -> dict:
    res = state["client"].query(state["instance"], [bytes.fromhex(h) for h in hashes])
    return {"num_blocks": res.num_blocks, "lease_id": res.lease_id}


def load(lease_id: int, block_ids: list[int], offset: int = 0) -> dict:
    res = state["client"].load(
        state["instance"],
        lease_id,
        block_ids,
        tp_rank=state["rank"],
        lease_offset=offset,
    )
    return {"loaded": res.loaded, "bytes": res.bytes}


OPS = {
    "init": init,
    "digest": digest,
    "register": register,
    "save": save,
    "query": query,
    "load": load,
}


def main() -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
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
