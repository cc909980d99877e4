"""Several GPUs saving or loading at once through one server (issue 32):
aggregate save and load GB/s for 1, 2, 4 ... N GPUs, each against two
ceilings taken in the same run: the sum of each GPU's own pinned cudaMemcpy
(measured alone, one GPU after another) and the host's memory bandwidth (a
plain multi-threaded memcpy of the same bytes; it reads and writes each, so
the DRAM traffic it shows is twice its rate: the bound a save, which only
writes, or a load, which only reads, is held to). Also the pinned copies of
all those GPUs at once, which is where the host's links stop them. Ratios
are of min(sum of ceilings, host traffic).

One engine process per GPU (CUDA_VISIBLE_DEVICES names its one GPU; the
server serves them all), each a transfer.Engine: the same KV, saves and byte
check as benchmarks/transfer.py. The processes start each phase at one
monotonic instant the parent names; a phase's rate is all their bytes over
the span from that instant to the last one's end.

    PYTHONPATH=$PWD python3 benchmarks/transfer_gpus.py --gpus N --out DIR
    PYTHONPATH=$PWD python3 benchmarks/transfer.py --gpus N --out DIR  # the same
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table  # noqa: E402
from pegaflow.demo.spawn import spawn_server  # noqa: E402

N_BLOCKS = 640  # per GPU: the goal is stated at 640 blocks per rank
REPS = 12  # timed saves (and loads) per GPU and phase
START_S = 0.5  # from the parent's "go" to the common start instant


# -- the engine process, one per GPU -----------------------------------------
def worker(addr: str, http: str, layers: int, page: int, n: int) -> None:
    """Answers JSON lines: `check`, `ceiling`, then timed phases `save`,
    `load` and `memcpy`, each starting at `at` (time.monotonic, shared by
    every process on the host)."""
    import torch

    from benchmarks.transfer import Engine, ceiling_gbps

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    eng = Engine(addr, http, f"gpu{gpu}", layers, page, n)
    nbytes = n * layers * page
    pinned = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    src, dst = eng.ids(n, False)
    kept: list[bytes] = []

    def phase(cmd: dict[str, Any]) -> dict[str, Any]:
        nonlocal kept
        reps, op = cmd["reps"], cmd["op"]
        batches = [[secrets.token_bytes(32) for _ in range(n)] for _ in range(reps)]
        if op == "load":  # fresh blocks, resident whatever others evicted
            kept = [secrets.token_bytes(32) for _ in range(n)]
            eng.save(src, kept)
        torch.cuda.synchronize()
        time.sleep(max(0.0, cmd["at"] - time.monotonic()))
        start = time.monotonic()
        for hashes in batches:
            if op == "save":
                eng.save(src, hashes)
            elif op == "load":
                eng.load(dst, kept)
            else:  # memcpy: the same bytes, pinned, no server
                pinned.copy_(eng.buf[:nbytes], non_blocking=True)
                eng.buf[:nbytes].copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        if op == "save":
            kept = batches[-1]
        moved = nbytes * reps * (2 if op == "memcpy" else 1)
        return {"start": start, "end": time.monotonic(), "bytes": moved}

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "check":
            reply: dict[str, Any] = {"ok": eng.checked_round_trip(src, dst)}
        elif cmd["op"] == "ceiling":
            reply = {"GBps": ceiling_gbps(pinned, eng.buf, nbytes)}
        elif cmd["op"] == "exit":
            eng.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        else:
            reply = phase(cmd)
        print(json.dumps(reply), flush=True)


class Worker:
    """The parent's end of one engine process."""

    def __init__(self, gpu: int, addr: str, http: str, shape: tuple, n: int) -> None:
        _, layers, page = shape
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        argv = [sys.executable, __file__, "--worker", addr, http, str(layers),
                str(page), str(n)]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a GPU worker died (rc={self.proc.wait()})")
        return json.loads(line)

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.answer()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(op="exit")
            self.proc.wait(60)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):  # dead or hung
            self.proc.kill()
            self.proc.wait()


def together(workers: list[Worker], op: str, reps: int) -> float:
    """GB/s of `op` on every worker at once, from one start instant."""
    at = time.monotonic() + START_S
    for w in workers:
        w.send(op=op, reps=reps, at=at)
    got = [w.answer() for w in workers]
    span = max(g["end"] for g in got) - min(g["start"] for g in got)
    return sum(g["bytes"] for g in got) / span / 1e9


def host_memcpy_gbps(nbytes: int, threads: int | None = None) -> float:
    """Best of 3: `nbytes` copied between two touched host buffers by
    `threads` threads (numpy's copy leaves the GIL), each its own slice."""
    threads = threads or min(os.cpu_count() or 1, 64)
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    edges = np.linspace(0, nbytes, threads + 1).astype(np.int64)

    def part(i: int) -> None:
        np.copyto(dst[edges[i] : edges[i + 1]], src[edges[i] : edges[i + 1]])

    best = 0.0
    for _ in range(3):
        pool = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        t = time.perf_counter()
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    if dst.min(initial=1) != 1:  # every slice copied: the rate is of all bytes
        raise RuntimeError("host memcpy: some bytes were not copied")
    return best


def counts(gpus: int) -> list[int]:
    """1, 2, 4 ... and `gpus` itself."""
    out = [c for c in (1, 2, 4, 8, 16) if c < gpus]
    return [*out, gpus]


def run(args: argparse.Namespace) -> dict:
    """The table for 1 .. args.gpus GPUs (transfer.py's shapes: the first
    of --shapes), one server serving them all."""
    from benchmarks.transfer import SHAPES

    shape = next(s for s in SHAPES if s[0] in args.shapes.split(","))
    n = (args.sizes or [N_BLOCKS])[-1]
    reps = max(args.min_reps, REPS)
    per_gpu = n * shape[1] * shape[2]
    pool_gib = max(4, -(-3 * args.gpus * per_gpu // 2**30) + 1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        http = f"127.0.0.1:{sock.getsockname()[1]}"
    devices = ",".join(str(d) for d in range(args.gpus))
    proc, addr = spawn_server(
        "--pool-size", f"{pool_gib}gb", "--devices", devices, "--no-progress",
        "--log-level", "warning", "--http-addr", http, *args.server_arg,
    )  # fmt: skip
    workers: list[Worker] = []
    try:
        workers = [Worker(d, addr, http, shape, n) for d in range(args.gpus)]
        ok = [w.call(op="check")["ok"] for w in workers]
        solo = [w.call(op="ceiling")["GBps"] for w in workers]  # one at a time
        rows = [
            _row(workers[:c], solo[:c], ok[:c], reps, per_gpu)
            for c in counts(args.gpus)
        ]
        with urllib.request.urlopen(f"http://{http}/stats", timeout=10) as r:
            topology = json.loads(r.read()).get("topology")  # where pages were
    finally:
        for w in workers:
            w.close()
        proc.terminate()
        proc.wait(60)
    print(table(rows, list(rows[0])))
    extra = {
        "shape": shape[0],
        "blocks_per_gpu": n,
        "reps": reps,
        "pool_gib": pool_gib,
        "solo_ceilings_GBps": [round(c, 1) for c in solo],
        "topology": topology,
    }
    return {"rows": rows, "extra": extra}


def _row(
    workers: list[Worker], solo: list[float], ok: list[bool], reps: int, per_gpu: int
) -> dict[str, object]:
    save = together(workers, "save", reps)
    load = together(workers, "load", reps)
    pinned = together(workers, "memcpy", max(2, reps // 3))
    host = host_memcpy_gbps(per_gpu * len(workers))
    # A memcpy reads and writes each byte; a save only writes it to DRAM (a
    # load only reads it): the host's bound for copies is twice its rate.
    bound = min(sum(solo), 2 * host)
    return dict(
        gpus=len(workers),
        GiB_per_gpu=round(per_gpu / 2**30, 2),
        save_GBps=round(save, 1),
        load_GBps=round(load, 1),
        sum_ceilings_GBps=round(sum(solo), 1),
        pinned_together_GBps=round(pinned, 1),
        host_memcpy_GBps=round(host, 1),
        host_traffic_GBps=round(2 * host, 1),
        save_ratio=round(save / bound, 2),
        load_ratio=round(load / bound, 2),
        bytes_ok=all(ok),
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        addr, http, layers, page, n = argv[1:6]
        worker(addr, http, int(layers), int(page), int(n))
        return
    from benchmarks.common import write_json
    from benchmarks.transfer import build_parser

    args = build_parser().parse_args(argv)
    name = f"transfer-gpus{args.gpus}" + (f"-{args.tag}" if args.tag else "")
    out = str(Path(args.out) / f"{name}.json") if args.out else None
    print(f"wrote {write_json(name, run(args), out)}")


if __name__ == "__main__":
    main()
