"""`python -m pegaflow.demo`: two engine processes share one pegaflow-server.

Engine A computes ("prefills") a 10K-token prompt's KV, saves it, and is killed.
Engine B, a new process, asks for the same prompt's blocks, loads them into other
block ids, and checks every byte against what A had.

With --nodes 2 the two engines sit on two nodes (two servers and a metaserver
on this host, pegaflow.demo.two_nodes): B's blocks come from A's node.

With --restart-server the server itself (one it starts, on a pool file and an
SSD file in a temp directory) is SIGKILLed after engine A's save and restarted
on the same files before engine B asks: the cache outlives the server.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pegaflow.common.settings import parse_size

from . import two_nodes as demo_nodes
from .spawn import spawn_server

PAGE_SHAPE = (8, 16, 256)  # Llama-3.1-8B per layer and block: kv_heads, block, 2*head
PAGE_BYTES = int(np.prod(PAGE_SHAPE)) * 2  # bf16
# The pool a demo server needs for the prompt: room beside it, and its hit
# leased whole under the server's --max-leased-share (0.9).
POOL_PER_PROMPT = 1.15


@dataclass(frozen=True)
class Shape:
    layers: int
    blocks: int  # engine KV capacity in blocks
    prompt_blocks: int
    block_size: int


def block_hashes(tokens: np.ndarray, block_size: int) -> list[bytes]:
    """Chained per-block hashes over full blocks, as vLLM's prefix cache does."""
    out, parent = [], b"pegaflow-demo"
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size].tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        out.append(parent)
    return out


def _kv(shape: Shape) -> tuple[np.ndarray, list[np.ndarray]]:
    from pegaflow.client.kv_layouts import vllm_layer_views

    buf = np.empty(shape.layers * shape.blocks * PAGE_BYTES, np.uint8)
    buf.fill(0)  # touch it, as an engine's allocator does: no page faults mid-load
    return buf, vllm_layer_views(buf, shape.layers, shape.blocks, (PAGE_BYTES,))


def _prefill_bytes(seed: int, shape: Shape) -> np.ndarray:
    """Deterministic stand-in for the prompt's KV: [layers, blocks, page] bytes."""
    raw = np.random.default_rng(seed).bytes(
        shape.layers * shape.prompt_blocks * PAGE_BYTES
    )
    return np.frombuffer(raw, np.uint8).reshape(shape.layers, shape.prompt_blocks, -1)


def _engine_setup(
    shape: Shape, seed: int, ids_seed: int
) -> tuple[list[bytes], list[np.ndarray], np.ndarray]:
    """The shared prompt's block hashes, this engine's KV views, and the block
    ids its allocator gave the prompt (each engine gets different ones)."""
    tokens = np.random.default_rng(seed).integers(
        0, 128_000, shape.prompt_blocks * shape.block_size
    )
    _, views = _kv(shape)
    ids = np.random.default_rng(ids_seed).permutation(shape.blocks)
    return block_hashes(tokens, shape.block_size), views, ids[: shape.prompt_blocks]


def _reporting(
    name: str, body: Callable[..., None], addr: str, shape: Shape, seed: int, conn: Any
) -> None:
    """An engine process's body whose failure (the server's refusal, or no
    server) reaches the demo as one line, not a traceback and a hung pipe."""
    from pegaflow.common.errors import PegaflowError

    try:
        body(addr, shape, seed, conn)
    except (PegaflowError, OSError) as exc:
        conn.send({"error": f"{name}: {exc}"})


def _engine_a(addr: str, shape: Shape, seed: int, conn: Any) -> None:
    from pegaflow.client.kv_layouts import describe
    from pegaflow.client.pegaflow_client import PegaflowClient

    hashes, views, ids = _engine_setup(shape, seed, seed + 1)
    kv = _prefill_bytes(seed, shape)
    for layer, view in enumerate(views):
        view[ids] = kv[layer]
    mem = describe(views)
    with PegaflowClient(addr, timeout_s=60) as client:
        client.register_host(
            "engine-a", "demo-llama-8b", os.getpid(), mem.regions, mem.layers
        )
        session = client.open_session("engine-a")
        start = time.perf_counter()
        res = client.save("engine-a", ids, hashes)
        conn.send({"stored": res.stored, "seconds": time.perf_counter() - start})
        signal.pause()  # wait for the kill, session open
        session.close()


def _engine_b(addr: str, shape: Shape, seed: int, conn: Any) -> None:
    from pegaflow.client.kv_layouts import describe
    from pegaflow.client.pegaflow_client import PegaflowClient

    hashes, views, ids = _engine_setup(shape, seed, seed + 2)
    mem = describe(views)
    with PegaflowClient(addr, timeout_s=60) as client:
        client.register_host(
            "engine-b", "demo-llama-8b", os.getpid(), mem.regions, mem.layers
        )
        session = client.open_session("engine-b")
        start = time.perf_counter()
        hit = client.query("engine-b", hashes)
        deadline = start + 30
        while hit.loading and time.perf_counter() < deadline:  # SSD or a peer
            time.sleep(0.01)
            hit = client.query("engine-b", hashes)
        queried = time.perf_counter()
        loaded_bytes = 0
        if hit.num_blocks:
            loaded = client.load("engine-b", hit.lease_id, ids[: hit.num_blocks])
            loaded_bytes = loaded.bytes
        seconds = time.perf_counter() - queried
        expected = _prefill_bytes(seed, shape)
        mismatched = sum(
            int(
                (view[ids[: hit.num_blocks]] != expected[layer, : hit.num_blocks])
                .any(axis=1)
                .sum()
            )
            for layer, view in enumerate(views)
        )
        session.close()
    conn.send(
        {
            "queried": len(hashes),
            "hit": hit.num_blocks,
            "bytes": loaded_bytes,
            "seconds": seconds,
            "query_seconds": queried - start,
            "mismatched_pages": mismatched,
            "checked_bytes": int(hit.num_blocks) * shape.layers * PAGE_BYTES,
        }
    )


# Picklable (partials of module functions): the engines are spawned processes.
engine_a = functools.partial(_reporting, "engine A", _engine_a)
engine_b = functools.partial(_reporting, "engine B", _engine_b)


class DemoFailed(Exception):
    """A cause the user can fix, said in one line."""


def _answer(conn: Any, prompt_blocks: int, proc: Any) -> dict:
    """An engine's report, or DemoFailed naming the cause and the fix (also
    when the engine process died without one: never a wait for ever)."""
    while not conn.poll(0.5):
        if not proc.is_alive() and not conn.poll(0):
            raise DemoFailed(
                f"the engine process exited (code {proc.exitcode}) without a "
                "report; its error is printed above"
            )
    got = conn.recv()
    if "error" not in got:
        return got
    why = got["error"]
    if "block_ids" in why or "RESOURCE_EXHAUSTED" in why:  # the pool's bounds
        why += (
            f" (the prompt is {prompt_blocks} blocks: give --tokens fewer, or "
            "the server a larger --pool-size)"
        )
    raise DemoFailed(why)


def _restart_files(pool_size: int) -> tuple[tempfile.TemporaryDirectory, ...]:
    """A temp dir for the pool file (in /dev/shm where there is one: a pool
    file on disk would be paged to it) and one for the SSD file."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return (
        tempfile.TemporaryDirectory(prefix="pegaflow-demo-pool-", dir=shm),
        tempfile.TemporaryDirectory(prefix="pegaflow-demo-ssd-"),
    )


def _start(
    pool_size: int, files: tuple[tempfile.TemporaryDirectory, ...]
) -> tuple[subprocess.Popen, str]:
    flags = ["--no-http", "--pool-size", str(pool_size), "--log-level", "warning"]
    if files:
        flags += ["--pool-file", os.path.join(files[0].name, "pool.bin")]
        flags += ["--ssd-cache-path", os.path.join(files[1].name, "ssd0.bin")]
        flags += ["--ssd-cache-capacity", str(pool_size), "--ssd-backend", "posix"]
    return spawn_server(*flags)


def _restart(
    server: subprocess.Popen,
    pool_size: int,
    files: tuple[tempfile.TemporaryDirectory, ...],
) -> tuple[subprocess.Popen, str]:
    server.send_signal(signal.SIGKILL)
    server.wait(30)
    print("server: SIGKILLed; restarting it on the same pool and SSD files", flush=True)
    start = time.perf_counter()
    server, addr = _start(pool_size, files)
    print(f"server: serving again in {time.perf_counter() - start:.2f} s", flush=True)
    return server, addr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pegaflow.demo", description=__doc__)
    p.add_argument("--addr", help="use a running server instead of starting one")
    p.add_argument("--pool-size", type=parse_size, default=parse_size("512mb"))
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument(
        "--layers",
        type=int,
        default=8,
        help="layers of Llama-3.1-8B shape (64 KiB pages; 32 = full model)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--restart-server",
        action="store_true",
        help="SIGKILL the server after engine A's save and restart it on the "
        "same pool file and SSD file (a server this demo starts itself)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        choices=[1, 2],
        default=1,
        help="2: engine A on node 1, engine B on node 2 (a metaserver and two "
        "servers this demo starts): B's hit is read from node 1",
    )
    args = p.parse_args(argv)
    if args.nodes == 2 and (args.addr or args.restart_server):
        p.error("--nodes 2 starts its own servers: leave out --addr/--restart-server")
    if args.restart_server and args.addr:
        p.error("--restart-server: needs a server the demo starts (drop --addr)")
    prompt_blocks = args.tokens // 16
    shape = Shape(args.layers, prompt_blocks * 2, prompt_blocks, 16)
    need = prompt_blocks * args.layers * PAGE_BYTES
    server = None
    addr = args.addr
    files: tuple = ()  # the restart demo's pool and SSD files
    if args.restart_server and addr is not None:
        p.error("--restart-server starts its own server: leave out --addr")
    stack = contextlib.ExitStack()
    nodes: list[dict[str, str]] = []
    if args.nodes == 2:
        if args.pool_size < need * POOL_PER_PROMPT:
            p.error(f"--pool-size: the prompt needs {need / 2**20:.0f} MiB; give more")
        try:
            nodes = demo_nodes.start_nodes(stack, args.pool_size, 2)
        except BaseException:  # those already started go too, not orphaned
            stack.close()
            raise
        addr = nodes[0]["grpc"]
    elif addr is None:
        if args.pool_size < need * POOL_PER_PROMPT:
            p.error(f"--pool-size: the prompt needs {need / 2**20:.0f} MiB; give more")
        print(
            f"starting pegaflow-server with a {args.pool_size / 2**20:.0f} MiB pool",
            flush=True,
        )
        files = _restart_files(args.pool_size) if args.restart_server else ()
        server, addr = _start(args.pool_size, files)
    ctx = mp.get_context("spawn")
    try:
        recv, send = ctx.Pipe(duplex=False)
        a = ctx.Process(target=engine_a, args=(addr, shape, args.seed, send))
        a.start()
        try:
            saved = _answer(recv, shape.prompt_blocks, a)
        finally:
            os.kill(a.pid, signal.SIGKILL)
            a.join()
        print(
            f"engine A: saved {saved['stored']} blocks "
            f"({need / 2**20:.0f} MiB) in {saved['seconds'] * 1e3:.1f} ms, "
            "then SIGKILLed",
            flush=True,
        )
        if args.restart_server:
            server, addr = _restart(server, args.pool_size, files)
        if nodes:
            took = demo_nodes.wait_advertised(nodes[0]["http"], shape.prompt_blocks)
            print(f"node 1: advertised to the metaserver in {took * 1e3:.0f} ms")
            addr = nodes[1]["grpc"]
        b = ctx.Process(target=engine_b, args=(addr, shape, args.seed, send))
        b.start()
        try:
            got = _answer(recv, shape.prompt_blocks, b)
        finally:
            b.join()
        remote = demo_nodes.remote_stats(nodes[1]["http"]) if nodes else None
    except DemoFailed as exc:
        print(f"demo: {exc}", file=sys.stderr)
        if files:
            files[0].cleanup()
        return 2
    finally:
        stack.close()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(30)
    gbps = got["bytes"] / got["seconds"] / 1e9
    print(
        f"engine B: hit {got['hit']}/{got['queried']} blocks "
        f"(hit rate {got['hit'] / got['queried']:.1%}), loaded {got['bytes']} bytes "
        f"into other block ids in {got['seconds'] * 1e3:.1f} ms ({gbps:.2f} GB/s; "
        f"query {got['query_seconds'] * 1e3:.2f} ms)"
    )
    if remote is not None:
        fetched, ms = remote["fetched_bytes"], remote["fetch_ms_last"]
        print(
            f"node 2: read {fetched} bytes from node 1 in {ms:.1f} ms "
            f"({fetched / ms / 1e6 if ms else 0:.2f} GB/s; query to ready, checksums "
            f"checked), failed: {remote['failed_blocks']}"
        )
    ok = got["mismatched_pages"] == 0 and got["hit"] == got["queried"]
    if files:
        files[0].cleanup()
    print(
        f"verified {got['checked_bytes']} bytes: "
        f"{'all equal' if ok else str(got['mismatched_pages']) + ' pages differ'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
