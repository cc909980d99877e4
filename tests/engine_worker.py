"""A scripted engine process holding torch KV tensors, on the CPU or a GPU
(`init(device="cuda:0")`); run by tests/procs.py.

Reads one JSON command per line on stdin and answers one JSON line on stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback

import torch

from pegaflow.client.kv_layouts import describe
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import CopyFailed

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
    device: str = "cpu",
    mla_dim: int = 576,
    page_aligned: bool = False,
) -> dict:
    """KV in one of the layouts: LBNHC / BLNHC (vLLM 0.33, one int8 buffer with
    per-layer views), kv_first (older vLLM, [2, blocks, block_size, heads, head]
    per layer) or MLA (one buffer, per-layer [blocks, block_size, mla_dim])."""
    if device != "cpu":  # a rank on GPU k, all GPUs visible (as vLLM's workers)
        torch.cuda.set_device(device)
    dt = getattr(torch, dtype)
    item = torch.empty((), dtype=dt).element_size()
    gen = torch.Generator(device).manual_seed(seed)

    def rand(n: int) -> torch.Tensor:  # seeded random bytes, made where they live
        return torch.randint(
            -128, 128, (n,), dtype=torch.int8, generator=gen, device=device
        )

    state.pop("buffer", None)
    if (
        layout == "kv_first"
    ):  # older vLLM: per layer [2, blocks, block_size, heads, head]
        shape = (2, blocks, block_size, heads, head)
        n = 2 * blocks * block_size * heads * head * item
        tensors = [rand(n).view(dt).view(shape) for _ in range(layers)]
        kv_first = True
    elif layout == "MLA":  # one buffer, per layer [blocks, block_size, mla_dim]
        buf = rand(layers * blocks * block_size * mla_dim * item)
        phys = buf.view(dt).view(layers, blocks, block_size, mla_dim)
        tensors = [phys[i] for i in range(layers)]
        state["buffer"] = buf
        kv_first = False
    else:  # vLLM 0.33: one int8 buffer, per-layer [blocks, heads, block_size, 2*head]
        page = heads * block_size * 2 * head * item
        buf = rand(layers * blocks * page)
        if page_aligned:  # its own mapping: no other data shares its pages
            import mmap

            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # shmem's pages never go
            state["mapping"] = mapping = mmap.mmap(-1, buf.numel(), flags=flags)
            buf = torch.frombuffer(mapping, dtype=torch.int8).copy_(buf)
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
    state.update(tensors=tensors, kv_first=kv_first, device=device)
    if device == "cpu":
        state["mem"] = describe(tensors, kv_first=kv_first)
    else:
        from pegaflow.client.cuda_export import export_kv

        state["mem"] = export_kv(tensors, kv_first=kv_first)
    return {"regions": len(state["mem"].regions)}


def _pages(block: int) -> bytes:
    """All bytes of one block, every layer, in the server's slot order."""
    out = []
    mem = state["mem"]
    host: dict[int, torch.Tensor] = {}  # region -> its bytes on the CPU, once
    for layer in mem.layers:
        i = layer.region_index
        if i not in host:
            host[i] = _region_bytes(i).cpu()
        for seg in layer.segments:
            start = layer.offset + block * layer.block_stride + seg.offset
            out.append(bytes(host[i][start : start + seg.size].numpy()))
    return b"".join(out)


def _region_bytes(index: int) -> torch.Tensor:
    region = state.get("buffer")
    if region is None:  # kv_first: one region per layer tensor
        region = state["tensors"][index]
    return region.reshape(-1).view(torch.uint8)


def _gpu_sleep(ms: float) -> None:
    """Keep the current stream busy, so later work visibly lags the host."""
    if ms > 0:
        torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz SM clock


def scribble(block_ids: list[int], seed: int, delay_ms: float = 0.0) -> dict:
    """New random bytes into the blocks of every layer, on the current stream
    after `delay_ms` of GPU sleep; returns without waiting for them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(block_ids, device=state["device"])
    pending = []
    for t in state["tensors"]:  # test helper: per layer is fine here
        raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)
        part = raw[:, ids] if state["kv_first"] else raw[ids]
        lo, hi = (0, 256) if raw.dtype == torch.uint8 else (-(1 << 15), 1 << 15)
        vals = torch.randint(lo, hi, part.shape, dtype=raw.dtype, generator=gen)
        pending.append((raw, vals.to(state["device"], non_blocking=True)))
    _gpu_sleep(delay_ms)
    for raw, vals in pending:
        if state["kv_first"]:
            raw[:, ids] = vals
        else:
            raw[ids] = vals
    return {"layers": len(pending)}


def digest(block_ids: list[int]) -> dict:
    return {"digests": [hashlib.sha256(_pages(b)).hexdigest() for b in block_ids]}


def register(
    addr: str,
    instance: str,
    namespace: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    session: bool = True,
    replicated: bool = False,
) -> dict:
    """replicated: every rank holds the same KV (MLA): one shard per block."""
    client = PegaflowClient(addr)
    mem = state["mem"]
    more = {"replicated": True} if replicated else {}
    if state.get("device", "cpu") == "cpu":
        reg = client.register_host(
            instance,
            namespace,
            os.getpid(),
            mem.regions,
            mem.layers,
            tp_rank=tp_rank,
            tp_size=tp_size,
            **more,
        )
    else:
        from pegaflow.client.cuda_export import IpcEvents

        if "events" not in state:
            state["events"] = IpcEvents(torch.device(state["device"]).index or 0)
        handles = state["events"].handles
        reg = client.register_cuda(
            instance, namespace, mem, handles, tp_rank=tp_rank, tp_size=tp_size, **more
        )
    state.update(client=client, instance=instance, rank=tp_rank)
    if session:
        state["session"] = client.open_session(instance, tp_rank, interval_s=1.0)
    return {"slot_bytes": reg.slot_bytes, "server_pid": reg.server_pid}


def unregister() -> dict:
    """Close the session and unregister (the server drops our mappings)."""
    state["client"].unregister(state["instance"], state["rank"])
    session = state.pop("session", None)
    if session is not None:  # after: its end would drop the worker itself
        session.close()
    return {"ok": True}


def save(
    block_ids: list[int],
    hashes: list[str],
    event: bool = False,
    delay_ms: float = 0,
    sync: bool = True,
) -> dict:
    """GPU: order the server's copy after our stream with an IPC event (`event`,
    after `delay_ms` of GPU sleep), or by a host sync first (`sync`), or not."""
    wait = 0
    if event:
        _gpu_sleep(delay_ms)
        wait = state["events"].record(torch.cuda.current_stream().cuda_stream)
    elif sync and state.get("device", "cpu") != "cpu":
        torch.cuda.synchronize()
    res = state["client"].save(
        state["instance"],
        block_ids,
        [bytes.fromhex(h) for h in hashes],
        tp_rank=state["rank"],
        wait_event=wait,
    )
    return {
        "stored": res.stored,
        "deduplicated": res.deduplicated,
        "rejected": res.rejected,
    }


def save_async(**kwargs: object) -> dict:
    """Start `save` in a thread and answer at once (to be killed mid-save)."""
    thread = threading.Thread(target=save, kwargs=kwargs, daemon=True)
    thread.start()
    time.sleep(0.05)  # let the request leave
    return {"started": True}


def query(hashes: list[str], wait_s: float = 0.0, poll_s: float = 0.001) -> dict:
    """wait_s > 0: poll every poll_s while the server answers `loading` (a
    slower tier or a peer is pulling the blocks in), as the connector does
    once per scheduler step, for up to wait_s."""
    raw = [bytes.fromhex(h) for h in hashes]
    start = time.perf_counter()
    res = state["client"].query(state["instance"], raw)
    end, polls = time.monotonic() + wait_s, 0
    while res.loading and time.monotonic() < end:
        time.sleep(poll_s)
        polls += 1
        res = state["client"].query(state["instance"], raw)
    return {
        "seconds": time.perf_counter() - start,
        "num_blocks": res.num_blocks,
        "lease_id": res.lease_id,
        "loading": res.loading,
        "polls": polls,
    }


def load(
    lease_id: int,
    block_ids: list[int],
    offset: int = 0,
    done_event: bool = False,
    done_index: int = 0,
    kill_when_answered: int = 0,
) -> dict:
    """done_event: name one of our load events (done_index: that index, as a
    bad engine might); a load answered in flight is waited for on it, as a
    GPU engine's connector does. kill_when_answered: SIGKILL that pid (the
    server) once the load is answered in flight, and say how the wait ended."""
    events = state.get("events")
    done = events.load_event() if done_event and events is not None else 0
    done = done_index or done
    sent = time.monotonic()
    res = state["client"].load(
        state["instance"],
        lease_id,
        block_ids,
        tp_rank=state["rank"],
        lease_offset=offset,
        done_event=done,
    )
    waited, error = 0.0, ""
    if res.in_flight:
        if kill_when_answered:
            os.kill(kill_when_answered, signal.SIGKILL)
        start = time.monotonic()
        try:
            events.wait(done, 30.0, res.bytes, sent, state["client"].connection_fd())
        except CopyFailed as exc:
            if not kill_when_answered:
                raise
            error = str(exc)
        waited = time.monotonic() - start
    return {"loaded": res.loaded, "bytes": res.bytes, "in_flight": res.in_flight,
            "waited_s": waited, "wait_error": error}  # fmt: skip


def stall(block: int) -> dict:
    """Block `block`'s whole pages in layer 0 stall every reader from now on
    (tests/uffd_stall.py): the server's copy of them waits until we exit."""
    from tests.uffd_stall import stall as stall_pages

    layer = state["mem"].layers[0]
    region = state["mem"].regions[layer.region_index]
    start = region[0] + layer.offset + block * layer.block_stride
    fd, first, size = stall_pages(start, layer.block_stride)
    state.setdefault("stalls", []).append(fd)
    return {"first": first, "bytes": size}


def stall_start() -> dict:
    """The first page of the first registered region (init(page_aligned=True):
    KV bytes only) stalls every reader from now on."""
    from tests.uffd_stall import PAGE
    from tests.uffd_stall import stall as stall_pages

    address = state["mem"].regions[0][0]
    if address % PAGE:
        raise ValueError("stall_start: init the KV with page_aligned=True")
    fd, first, size = stall_pages(address, PAGE)
    state.setdefault("stalls", []).append(fd)
    return {"first": first, "bytes": size, "regions": state["mem"].regions}


OPS = {
    "init": init,
    "digest": digest,
    "register": register,
    "unregister": unregister,
    "scribble": scribble,
    "save": save,
    "save_async": save_async,
    "query": query,
    "load": load,
    "stall": stall,
    "stall_start": stall_start,
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
