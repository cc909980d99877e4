"""Warm restart of L1 (--pool-file): time from exec to the first hit, and the
share of acknowledged blocks a restarted server serves, after SIGTERM and after
SIGKILL during steady saves.

    python benchmarks/restart.py                       # 2, 4 and 8 GiB pools
    python benchmarks/restart.py --sizes 16gb,64gb     # the H200 host
    python benchmarks/restart.py --quick               # 256 MiB, a smoke check

The pool file lives in --dir (default /dev/shm). One engine process (this one)
holds 256 blocks of 2 MiB (32 layers x 64 KiB, Llama-3.1-8B) and saves them
again and again under fresh hashes until the pool is --fill full, never
evicting; with sigkill a second thread keeps saving while the server is
SIGKILLed. A block counts as acknowledged when its save returned.

With --cuda-reader two GPU engines register beside the host engine as the
server restarts: one loads the first batch saved (slots at the pool's start,
the first chunks pinned), the other the last (slots far into the pool, whose
chunks the server pins last unless a copy asks for them first).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import start_server, table, write_json  # noqa: E402
from pegaflow.client.kv_layouts import describe, vllm_layer_views  # noqa: E402
from pegaflow.client.pegaflow_client import PegaflowClient  # noqa: E402
from pegaflow.common.errors import PegaflowError  # noqa: E402
from pegaflow.common.results import QueryResult  # noqa: E402
from pegaflow.common.settings import parse_size  # noqa: E402

PAGE = 64 << 10
LAYERS = 32
BLOCK = PAGE * LAYERS
BATCH = 64


class Engine:
    def __init__(self, blocks: int) -> None:
        self.buf = np.frombuffer(
            np.random.default_rng(0).bytes(LAYERS * blocks * PAGE), np.uint8
        ).copy()
        self.mem = describe(vllm_layer_views(self.buf, LAYERS, blocks, (PAGE,)))
        self.blocks = blocks
        self.block_of: dict[bytes, int] = {}  # each saved hash's block

    def register(self, client: PegaflowClient, inst: str) -> None:
        client.register_host(
            inst, "bench-restart", os.getpid(), self.mem.regions, self.mem.layers
        )


def _fill(
    addr: str,
    eng: Engine,
    target: int,
    stop: threading.Event,
    inst: str = "writer",
    killed: bool = False,
) -> list[bytes]:
    """Save batches under fresh hashes until `target` blocks or stop; the
    hashes of every acknowledged block."""
    acked: list[bytes] = []
    client = PegaflowClient(addr, timeout_s=60)
    try:
        eng.register(client, inst)
        while len(acked) < target and not stop.is_set():
            # Never past the target: more than the pool holds would be evicted,
            # acknowledged yet gone before any restart (not a loss of it).
            n = min(BATCH, target - len(acked))
            hs = [secrets.token_bytes(32) for _ in range(n)]
            ids = np.arange(len(acked), len(acked) + n) % eng.blocks
            if client.save(inst, ids, hs).stored == n:
                eng.block_of.update(zip(hs, ids.tolist(), strict=True))
                acked += hs
    except PegaflowError:
        if not killed:  # only a save under the SIGKILL may fail
            raise
    finally:
        with contextlib.suppress(PegaflowError):
            client.close()
    return acked


def _settled(client: PegaflowClient, inst: str, hs: list[bytes]) -> QueryResult:
    """A query asked again while it answers `loading` (blocks the restarted
    server has not checked yet), as an engine's scheduler does."""
    deadline = time.monotonic() + 600
    while (res := client.query(inst, hs)).loading:
        if time.monotonic() > deadline:
            raise TimeoutError("a query still loading after 600 s")
        time.sleep(0.001)
    return res


class CudaReader:
    """A GPU engine of the same namespace, its KV made and exported before the
    server starts: what it times is the server's side (its CUDA bring-up).
    `tail`: it loads the last batch saved instead of the first."""

    def __init__(self, blocks: int, tail: bool = False) -> None:
        import torch

        from pegaflow.client.cuda_export import export_kv

        self.buf = torch.zeros(LAYERS * blocks * PAGE, dtype=torch.uint8, device="cuda")
        self.kv = export_kv(vllm_layer_views(self.buf, LAYERS, blocks, (PAGE,)))
        self.blocks = blocks
        self.tail = tail
        self.got: dict = {}

    def first_hit(
        self, addr: str, start: float, acked: list[bytes], eng: Engine
    ) -> None:
        """Register (waits for the server's CUDA copy engine), load one batch
        into GPU blocks 0.., check every byte against the host engine."""
        import torch

        name = "gpu-reader-tail" if self.tail else "gpu-reader"
        hashes = acked[-BATCH:] if self.tail else acked[:BATCH]
        with PegaflowClient(addr, timeout_s=120) as client:
            client.register_cuda(name, "bench-restart", self.kv)
            registered = time.perf_counter() - start
            res = _settled(client, name, hashes)
            ids = np.arange(res.num_blocks)
            client.load(name, res.lease_id, ids)
            torch.cuda.synchronize()  # the load consumed its lease (one rank)
            hit = time.perf_counter() - start
        got = self.buf.view(LAYERS, self.blocks, PAGE)[:, : len(ids)].cpu().numpy()
        blocks = [eng.block_of[h] for h in hashes[: len(ids)]]
        want = eng.buf.reshape(LAYERS, eng.blocks, PAGE)[:, blocks]
        key = "cuda_tail" if self.tail else "cuda"
        self.got = {
            f"{key}_registered_s": round(registered, 2),
            f"{key}_{'hit' if self.tail else 'first_hit'}_s": round(hit, 2),
            f"{key}_hit_blocks": int(res.num_blocks),
            f"{key}_bytes_equal": bool(np.array_equal(got, want)),
        }


def _start_steps(log: str) -> dict[str, str]:
    """The restarted server's own account of its start (pegaflow.server.
    start_clock): its steps to READY, and the CUDA bring-up's."""
    out = {}
    for line in log.splitlines():
        for key, marker in (
            ("server_start", "started in "),
            ("cuda_bringup", "CUDA copy engine ready in "),
            ("pinned", "pool pinned for the GPUs: "),
            ("checked", "pool file: checked in "),
            ("xxh3", "xxh3 row loop compiled in "),
        ):
            if marker in line:  # the log's clock (ms) ends each: when it came
                out[key] = f"{line.split(marker, 1)[1]} (at {line[11:23]})"
    return out


def _first_hit(
    flags: list[str], eng: Engine, acked: list[bytes], gpus: list[CudaReader]
) -> dict:
    log = tempfile.TemporaryFile()  # noqa: SIM115 (read after the stop, then closed)
    start = time.perf_counter()
    proc, addr = start_server(*flags, "--log-level", "info", stderr=log)
    ready = time.perf_counter() - start
    readers = [  # beside the host engine, as GPU engines would start
        threading.Thread(target=gpu.first_hit, args=(addr, start, acked, eng))
        for gpu in gpus
    ]
    for reader in readers:
        reader.start()
    with PegaflowClient(addr, timeout_s=120) as client:
        eng.register(client, "reader")
        first = _settled(client, "reader", acked[:BATCH])
        hit_s = time.perf_counter() - start
        if first.lease_id:
            client.release_lease(first.lease_id)
        hits = 0
        for h in acked:  # one by one: a prefix query stops at the first miss
            res = _settled(client, "reader", [h])
            hits += res.num_blocks
            if res.lease_id:
                client.release_lease(res.lease_id)
        all_s = time.perf_counter() - start
    for reader in readers:
        reader.join()
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    log.seek(0)
    steps = _start_steps(log.read().decode(errors="replace"))
    log.close()
    return {
        "ready_s": round(ready, 2),
        "first_hit_s": round(hit_s, 2),
        "first_hit_blocks": first.num_blocks,
        "all_hit_s": round(all_s, 2),
        "hits": hits,
        **{k: v for gpu in gpus for k, v in gpu.got.items()},
        **steps,
    }


def fit(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per stop mode, exec-to-first-hit as fixed s + s per GiB (least squares
    over the sizes run; two sizes at least)."""
    out: dict[str, dict[str, float]] = {}
    for mode in ("sigterm", "sigkill"):
        mine = [r for r in rows if r["stop"] == mode]
        if len({r["pool_gib"] for r in mine}) < 2:
            continue
        gib = np.array([r["pool_gib"] for r in mine])
        secs = np.array([r["first_hit_s"] for r in mine])
        slope, fixed = np.polyfit(gib, secs, 1)
        out[mode] = {
            "fixed_s": round(float(fixed), 2),
            "s_per_gib": round(float(slope), 3),
        }
    return out


def run(
    size: int, mode: str, fill: float, directory: str, gpus: list[CudaReader]
) -> dict:
    path = os.path.join(directory, f"bench-restart-{os.getpid()}.pool")
    flags = ["--pool-size", str(size), "--pool-file", path, "--no-progress"]
    eng = Engine(256)
    target = int(size * fill) // BLOCK // BATCH * BATCH
    proc, addr = start_server(*flags)
    try:
        stop = threading.Event()
        if mode == "sigterm":
            acked = _fill(addr, eng, target, stop)
            proc.send_signal(signal.SIGTERM)
        else:  # most of the pool, then SIGKILL while a writer keeps saving
            acked = _fill(addr, eng, target * 3 // 4, stop)
            out: list[list[bytes]] = []
            writer = threading.Thread(
                target=lambda: out.append(
                    _fill(addr, eng, target // 4, stop, "writer2", True)
                )
            )
            writer.start()
            time.sleep(0.5)  # steady saves under way (a measurement, not a sync)
            proc.send_signal(signal.SIGKILL)
            writer.join()
            acked += out[0]
        proc.wait(120)
        got = _first_hit(flags, eng, acked, gpus)
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {
        "pool_gib": size / (1 << 30),
        "stop": mode,
        "acked_blocks": len(acked),
        **got,
        "recovered_share": round(got["hits"] / max(1, len(acked)), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2gb,4gb,8gb")
    # below 1: slots skewed to the engine's pages fit 7 of 2 MiB in a 16 MiB
    # slab; past the room the oldest blocks would be evicted, not lost
    p.add_argument("--fill", type=float, default=0.8)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--stops", default="sigterm,sigkill", help="how the first server stops"
    )
    p.add_argument(
        "--cuda-reader",
        action="store_true",
        help="also time two GPU engines' first hits, on the first and on the "
        "last batch saved (registration waits for the server's CUDA copy "
        "engine, a load for the pool chunks it reads); needs torch with CUDA",
    )
    args = p.parse_args()
    sizes = [256 << 20] if args.quick else list(map(parse_size, args.sizes.split(",")))
    gpus = [CudaReader(BATCH), CudaReader(BATCH, tail=True)] if args.cuda_reader else []
    rows = [
        run(s, m, args.fill, args.dir, gpus)
        for s in sizes
        for m in args.stops.split(",")
    ]
    cols = ["pool_gib", "stop", "acked_blocks", "ready_s", "first_hit_s", "all_hit_s"]
    if gpus:
        cols += ["cuda_registered_s", "cuda_first_hit_s", "cuda_bytes_equal",
                 "cuda_tail_hit_s", "cuda_tail_bytes_equal"]  # fmt: skip
    print(table(rows, [*cols, "hits", "recovered_share"]))
    slopes = fit(rows)
    for mode, f in slopes.items():
        print(f"{mode}: exec -> first hit = {f['fixed_s']} s + {f['s_per_gib']} s/GiB")
    payload = {"rows": rows, "fit": slopes, "fill": args.fill}
    print(write_json("restart", payload, args.json))


if __name__ == "__main__":
    main()
