"""GPU data path through a real server: save/load GB/s of torch CUDA KV (vLLM
0.33 layout: one int8 buffer, per-layer pages) from this process, next to one
pinned cudaMemcpy of the same bytes (the ceiling); save + load at once; 1-block
end-to-end latency; pool bring-up; optionally a 10K-token prefill for the
warm/cold ratio (benchmarks/transfer_extras.py).

Every timed transfer kind is byte-checked once: a save, then a load into
poisoned other blocks, compared on the GPU.

    PYTHONPATH=$PWD python3 benchmarks/transfer.py --out DIR [--quick] [--prefill]
        [--copy-path auto|kernel|dma] [--copy-sm-cap N] [--tag NAME] [--sizes 1,64]
    ... --interference [--copy-paths kernel,dma,auto] [--copy-sm-caps 16,66]
    ... --gpus N  (one engine per GPU, all at once: benchmarks/transfer_gpus.py)

`--interference` is the engine-interference mode (benchmarks/interference.py):
a bf16 matmul loop in a second process while saves, loads or both stream, for
each server setting, reported as copy GB/s next to the matmul's slowdown.
torch is imported where the GPU is used: argument parsing and the tables
import without it.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import interference, phase_trace  # noqa: E402
from benchmarks.common import metric_lines, metric_totals, table, write_json  # noqa: E402
from pegaflow.client.busy_poll import GPU_ENGINE_BUSY_POLL_US  # noqa: E402
from pegaflow.client.cuda_export import IpcEvents, export_kv  # noqa: E402
from pegaflow.client.kv_layouts import vllm_layer_views  # noqa: E402
from pegaflow.client.pegaflow_client import PegaflowClient  # noqa: E402
from pegaflow.copiers.measured import PATHS  # noqa: E402
from pegaflow.demo.spawn import spawn_server  # noqa: E402

if TYPE_CHECKING:
    import torch

# (name, layers, page bytes): Llama-3.1-8B (8 KV heads x 16 tokens x 2 x 128 x
# bf16) and DeepSeek-V3 MLA (block 64 x 576 x bf16).
SHAPES = (("llama-3.1-8b", 32, 64 << 10), ("mla-dsv3", 61, 64 * 576 * 2))
POISON = -85
# Server-side seconds, summed, from /metrics: copy alone and the whole RPC
# (over gRPC or the unix socket, whichever the client took).
SUMS = {
    "save_copy": ('pegaflow_transfer_seconds_sum{direction="save"}',),
    "load_copy": ('pegaflow_transfer_seconds_sum{direction="load"}',),
    "save_rpc": (
        'pegaflow_rpc_seconds_sum{code="OK",method="Save",transport="grpc"}',
        'pegaflow_rpc_seconds_sum{code="OK",method="Save",transport="unix"}',
    ),
    "load_rpc": (
        'pegaflow_rpc_seconds_sum{code="OK",method="Load",transport="grpc"}',
        'pegaflow_rpc_seconds_sum{code="OK",method="Load",transport="unix"}',
    ),
}


WARM_REPS = 30  # untimed turns of latency() before its timed ones


def server_sums(http: str) -> dict[str, float]:
    lines = metric_lines(http)
    prefixes = {p + " ": key for key, names in SUMS.items() for p in names}
    got = {key: 0.0 for key in SUMS}
    for line in lines:
        for prefix, key in prefixes.items():
            if line.startswith(prefix):
                got[key] += float(line[len(prefix) :])
    return got


def path_race(http: str) -> list[dict] | None:
    """GPU 0's copy-path race under --copy-path auto, per size class: each
    path's best GB/s and the winner (pegaflow.copiers.path_race); None
    where a path is forced."""
    gpu = interference.copy_path_gpu0(http)
    return None if gpu is None else gpu.get("classes")


def latency_paths(http: str, before: dict[str, int]) -> dict[str, object]:
    """Under --copy-path auto, the bytes each path moved during the 1-block
    round trips and where the contention check stood after them: a 1-block
    batch follows the crossover table unless contention sent kernels' share
    to copy engines."""
    gpu = interference.copy_path_gpu0(http)
    if gpu is None:
        return {}
    after = interference.path_counts(http)
    moved = {f"lat_{p}_MiB": round((after[p] - before[p]) / 2**20, 1) for p in PATHS}
    return moved | {"lat_contention_choice": gpu["choice"]}


# With an SSD tier (--server-arg=--ssd-cache-path=...): what the writers did
# meanwhile, for the write-behind cost on the GPU path (issue 13).
SSD_COUNTS = {
    "ssd_written_GiB": "pegaflow_ssd_written_bytes_total",
    "ssd_blocks_written": "pegaflow_ssd_written_blocks_total",
    "ssd_writes_dropped": "pegaflow_ssd_spills_dropped_total",
}


def ssd_counts(http: str) -> dict[str, float]:
    values = metric_totals(http)
    got = {key: values.get(name, 0.0) for key, name in SSD_COUNTS.items()}
    got["ssd_written_GiB"] = round(got["ssd_written_GiB"] / 2**30, 3)
    return got


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


class Engine:
    """One engine's KV in GPU memory, registered with the server over CUDA IPC."""

    def __init__(
        self,
        addr: str,
        http: str,
        name: str,
        layers: int,
        page: int,
        n_max: int,
        busy_poll_us: int = 0,
        done_events: bool = False,
    ) -> None:
        import torch

        self.http = http
        self.done_events, self.in_flight = done_events, 0
        self.layers, self.page = layers, page
        self.blocks = 2 * n_max + 64
        self.buf = torch.randint(
            -128, 128, (layers * self.blocks * page,), dtype=torch.int8, device="cuda"
        )
        self.view = self.buf.view(layers, self.blocks, page)
        views = vllm_layer_views(self.buf, layers, self.blocks, (page,))
        self.events = IpcEvents(0)
        self.client = PegaflowClient(addr, timeout_s=300, busy_poll_us=busy_poll_us)
        kv = export_kv(views)
        self.client.register_cuda(name, f"ns-{name}", kv, self.events.handles)
        self.name = name
        self.rng = np.random.default_rng(0)

    def ids(self, n: int, contiguous: bool) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination block ids, disjoint."""
        if contiguous:
            return np.arange(n), np.arange(n) + self.blocks // 2
        perm = self.rng.permutation(self.blocks)
        return perm[:n], perm[n : 2 * n]

    def save(self, src: np.ndarray, hashes: list[bytes], event: bool = True) -> float:
        import torch

        t = time.perf_counter()
        wait = (
            self.events.record(torch.cuda.current_stream().cuda_stream) if event else 0
        )
        res = self.client.save(self.name, src, hashes, wait_event=wait)
        assert res.stored == len(src), res
        return time.perf_counter() - t

    def load(self, dst: np.ndarray, hashes: list[bytes], gap_s: float = 0.0) -> float:
        """Until the blocks landed: with done events (the connector's
        loads_in_flight) the server may answer as the copy is queued, and we
        wait on our own event, as the connector then does."""
        hit = self.client.query(self.name, hashes)
        assert hit.num_blocks == len(hashes), hit
        time.sleep(gap_s)  # between the query and the load, as between steps
        t = time.perf_counter()
        done = self.events.load_event() if self.done_events else 0
        sent = time.monotonic()
        res = self.client.load(self.name, hit.lease_id, dst, done_event=done)
        if res.in_flight:
            self.events.wait(done, 30.0, res.bytes, sent, self.client.connection_fd())
            self.in_flight += 1
        assert res.loaded == len(dst), res
        return time.perf_counter() - t

    def checked_round_trip(self, src: np.ndarray, dst: np.ndarray) -> bool:
        import torch

        s, d = torch.as_tensor(src).cuda(), torch.as_tensor(dst).cuda()
        self.view[:, d] = POISON
        torch.cuda.synchronize()
        hashes = [secrets.token_bytes(32) for _ in src]
        self.save(src, hashes)
        self.load(dst, hashes)
        return bool(torch.equal(self.view[:, s], self.view[:, d]))

    def close(self) -> None:
        self.client.unregister(self.name)
        self.client.close()


def ceiling_gbps(pinned: torch.Tensor, dev: torch.Tensor, nbytes: int) -> float:
    """Best of 3: one pinned cudaMemcpy each way of nbytes (in <=2 GiB pieces)."""
    import torch

    best = {"d2h": 0.0, "h2d": 0.0}
    for _ in range(3):
        for way in best:
            torch.cuda.synchronize()
            t = time.perf_counter()
            left = nbytes
            while left:
                n = min(left, pinned.numel())
                if way == "d2h":
                    pinned[:n].copy_(dev[:n], non_blocking=True)
                else:
                    dev[:n].copy_(pinned[:n], non_blocking=True)
                left -= n
            torch.cuda.synchronize()
            best[way] = max(best[way], nbytes / (time.perf_counter() - t) / 1e9)
    return min(best.values())


def bench_shape(
    addrs: tuple[str, str],
    shape: tuple[str, int, int],
    sizes: list[int],
    ceil: dict,
    min_reps: int = 3,
    lat_reps: int = 200,
    lat_gap_s: float = 0.0,
    busy_poll_us: int = 0,
    done_events: bool = False,
) -> tuple[list[dict], dict]:
    name, layers, page = shape
    addr, http = addrs
    eng = Engine(addr, http, name, layers, page, max(sizes), busy_poll_us, done_events)
    rows = []
    for n in sizes:
        for contiguous in (True, False):
            src, dst = eng.ids(n, contiguous)
            ok = eng.checked_round_trip(src, dst)
            reps = max(min_reps, min(30, 640 // n))
            saves, loads = [], []
            before = server_sums(eng.http)
            for _ in range(reps):
                hashes = [secrets.token_bytes(32) for _ in range(n)]
                saves.append(eng.save(src, hashes))
                loads.append(eng.load(dst, hashes))
            srv = _delta(before, server_sums(eng.http))
            nbytes = n * layers * page
            if nbytes not in ceil:
                ceil[nbytes] = ceiling_gbps(ceil["pinned"], eng.buf, nbytes)
            c = ceil[nbytes]
            save_gb = nbytes / statistics.median(saves) / 1e9
            load_gb = nbytes / statistics.median(loads) / 1e9
            rows.append(
                dict(
                    shape=name,
                    N=n,
                    ids="contig" if contiguous else "random",
                    MiB=round(nbytes / 2**20, 1),
                    save_GBps=round(save_gb, 1),
                    load_GBps=round(load_gb, 1),
                    ceiling_GBps=round(c, 1),
                    save_ratio=round(save_gb / c, 2),
                    load_ratio=round(load_gb / c, 2),
                    save_copy_GBps=round(nbytes * reps / srv["save_copy"] / 1e9, 1),
                    load_copy_GBps=round(nbytes * reps / srv["load_copy"] / 1e9, 1),
                    save_rpc_ms=round(1e3 * srv["save_rpc"] / reps, 2),
                    load_rpc_ms=round(1e3 * srv["load_rpc"] / reps, 2),
                    bytes_ok=ok,
                )
            )
            print(rows[-1], flush=True)
    extra = {}
    if name.startswith("llama"):
        n = 640 if max(sizes) >= 640 else max(sizes)
        paths_before = interference.path_counts(http)
        extra = latency(eng, lat_reps, lat_gap_s)
        extra |= latency_paths(http, paths_before) | concurrent(addr, eng, n)
    extra["loads_in_flight"] = eng.in_flight  # answered before their copy ended
    eng.close()
    return rows, extra


def latency(eng: Engine, reps: int = 200, gap_s: float = 0.0) -> dict:
    """1 block x all layers, RPC + copy + completion seen here, ms: an
    event-ordered save, an engine-synced save and a load take turns, after
    WARM_REPS untimed turns. Timed one kind after another, whichever ran
    first (right after the large rows) read 0.05-0.27 ms slower than the
    next on the same server (H100, 2026-12-06, benchmarks/RESULTS.md). gap_s:
    idle time before each timed call (an engine asks once a decode step;
    back to back understates it, RESULTS.md "seventh session")."""
    import torch

    src, dst = np.array([3]), np.array([eng.blocks - 1])
    kept = [secrets.token_bytes(32)]
    eng.save(src, kept)
    times: dict[str, list[float]] = {"save_event": [], "save_synced": [], "load": []}
    before = None
    for turn in range(WARM_REPS + reps):
        if turn == WARM_REPS:
            before = server_sums(eng.http)
        time.sleep(gap_s)
        event = eng.save(src, [secrets.token_bytes(32)], event=True)
        torch.cuda.synchronize()  # the engine orders by syncing itself
        time.sleep(gap_s)
        synced = eng.save(src, [secrets.token_bytes(32)], event=False)
        load = eng.load(dst, kept, gap_s)
        if turn >= WARM_REPS:
            for kind, took in zip(times, (event, synced, load), strict=True):
                times[kind].append(took)
    srv = _delta(before, server_sums(eng.http))
    out = {"lat_gap_ms": round(gap_s * 1e3, 3), "lat_reps": reps}
    for kind, got in times.items():
        out[f"lat_{kind}_p50_ms"] = round(1e3 * statistics.median(got), 3)
        out[f"lat_{kind}_p90_ms"] = round(1e3 * np.percentile(got, 90), 3)
    for kind, saves in (("save", 2 * reps), ("load", reps)):
        out[f"lat_{kind}_server_rpc_mean_ms"] = round(
            1e3 * srv[f"{kind}_rpc"] / saves, 3
        )
        out[f"lat_{kind}_copy_mean_ms"] = round(1e3 * srv[f"{kind}_copy"] / saves, 3)
    return out


def concurrent(addr: str, eng: Engine, n: int, seconds: float = 2.0) -> dict:
    """Saves and loads of n blocks at once, from two threads: one client, whose
    socket has a connection per thread (a second client could not load for
    this engine: only its registration's owner may)."""
    src, dst = eng.ids(n, False)
    kept = [secrets.token_bytes(32) for _ in range(n)]
    eng.save(src, kept)
    nbytes = n * eng.layers * eng.page
    done = {"save": 0, "load": 0}
    stop = time.perf_counter() + seconds
    loader = eng.client

    def loads() -> None:
        while time.perf_counter() < stop:
            hit = loader.query(eng.name, kept)
            loader.load(eng.name, hit.lease_id, dst)
            done["load"] += 1

    thread = threading.Thread(target=loads)
    start = time.perf_counter()
    thread.start()
    while time.perf_counter() < stop:
        eng.save(src, [secrets.token_bytes(32) for _ in range(n)])
        done["save"] += 1
    thread.join()
    wall = time.perf_counter() - start
    return {
        "both_N": n,
        "both_save_GBps": round(done["save"] * nbytes / wall / 1e9, 1),
        "both_load_GBps": round(done["load"] * nbytes / wall / 1e9, 1),
        "both_total_GBps": round(
            (done["save"] + done["load"]) * nbytes / wall / 1e9, 1
        ),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for transfer.json")
    p.add_argument("--tag", default="", help="transfer-TAG.json, for variants")
    p.add_argument("--quick", action="store_true", help="small sizes, small pool")
    p.add_argument("--prefill", action="store_true", help="10K-token prefill too")
    p.add_argument("--bringup-gib", type=int, default=64)
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="comma-separated N blocks (default 1,16,64,640,2560; --quick 1,16,64)",
    )
    p.add_argument(
        "--shapes",
        default=",".join(name for name, _, _ in SHAPES),
        help="comma-separated shape names (default: all)",
    )
    p.add_argument("--min-reps", type=int, default=3, help="timed reps per N at least")
    p.add_argument(
        "--lat-reps",
        type=_at_least_one,
        default=200,
        help="1-block round trips timed per kind",
    )
    p.add_argument(
        "--profile-server",
        default=None,
        help="run the server under cProfile, its stats written to this file",
    )
    p.add_argument(
        "--busy-poll-us",
        type=int,
        default=GPU_ENGINE_BUSY_POLL_US,
        help="the engine's client polls for each reply this long before "
        "sleeping (PegaflowClient(busy_poll_us=...); default: what the "
        f"connector polls on a GPU engine, {GPU_ENGINE_BUSY_POLL_US})",
    )
    p.add_argument(
        "--load-answer",
        choices=("event", "done"),
        default="event",
        help="event (the default, the connector's loads_in_flight): each load "
        "names one of the engine's IPC events, the server may answer as its "
        "copy is queued and the engine waits on the event; done: the server "
        "answers once the copy is done",
    )
    p.add_argument(
        "--lat-gap-ms",
        type=float,
        default=0.0,
        help="idle time before each timed 1-block round trip (an engine's step "
        "cadence, e.g. 10; default 0: back to back)",
    )
    p.add_argument(
        "--trace-server",
        default=None,
        help="time the server's request path (benchmarks/phase_trace.py), "
        "its JSON written to this file when the server stops",
    )
    p.add_argument(
        "--trace-target",
        action="append",
        default=[],
        help="another 'module:Class.method' for --trace-server to time",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more server flag, e.g. --server-arg=--use-hugepages (repeatable)",
    )
    p.add_argument(
        "--gpus",
        type=_gpus,
        default=1,
        help="N > 1: every GPU saving or loading at once, aggregate GB/s for "
        "1, 2, 4 .. N GPUs (benchmarks/transfer_gpus.py); default 1: this GPU",
    )
    p.add_argument("--copy-path", choices=interference.PATHS, default="auto")
    p.add_argument("--copy-sm-cap", type=int, default=interference.DEFAULT_CAP)
    interference.add_arguments(p)
    return p


def _gpus(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 16:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1..16 GPUs")
    return int(text)


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 1")
    return n


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need N >= 1, comma-separated")
    return sizes


def start_server(
    pool: str,
    *extra: str,
    profile: str | None = None,
    trace: str | None = None,
    targets: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str, str]:
    """(process, gRPC address, HTTP address) of a server on GPU 0; with
    `profile`, under cProfile (its event loop thread: the server's Python
    bookkeeping, not the copy threads), stats written when it stops; with
    `trace`, under benchmarks/phase_trace.py (durations of named calls: its
    TARGETS and `targets`)."""
    with socket.socket() as sock:  # a free port for /metrics
        sock.bind(("127.0.0.1", 0))
        http = f"127.0.0.1:{sock.getsockname()[1]}"
    proc, addr = spawn_server(
        "--pool-size", pool, "--devices", "0", "--no-progress",
        "--log-level", "warning", "--http-addr", http, *extra,
        python_args=phase_trace.python_args(
            profile, trace, phase_trace.TARGETS + targets
        ),
    )  # fmt: skip
    return proc, addr, http


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    name = "interference" if args.interference else "transfer"
    name += f"-{args.tag}" if args.tag else ""
    out = str(Path(args.out) / f"{name}.json") if args.out else None

    def save(payload: dict) -> Path:
        return write_json(name, payload, out)

    if args.gpus > 1:  # its own file name: transfer-gpusN[-TAG].json
        from benchmarks import transfer_gpus

        transfer_gpus.main(argv if argv is not None else sys.argv[1:])
    elif args.interference:
        print(f"wrote {save(interference.run(args, save))}")
    else:
        print(f"wrote {save(run_shapes(args))}")


def run_shapes(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.transfer_extras import bring_up, prefill_seconds

    sizes = args.sizes or ([1, 16, 64] if args.quick else [1, 16, 64, 640, 2560])
    pool = "4gb" if args.quick else "16gb"
    setting = interference.Setting(args.copy_path, args.copy_sm_cap)
    proc, addr, http = start_server(
        pool,
        *setting.server_args(),
        *args.server_arg,
        profile=args.profile_server,
        trace=args.trace_server,
        targets=tuple(args.trace_target),
    )

    ceil = {"pinned": torch.empty(2 << 30, dtype=torch.int8, pin_memory=True)}
    rows, extra = [], {"copy_path": args.copy_path, "copy_sm_cap": args.copy_sm_cap,
                       "server_args": args.server_arg,
                       "busy_poll_us": args.busy_poll_us,
                       "load_answer": args.load_answer}  # fmt: skip
    try:
        for shape in SHAPES:
            if shape[0] in args.shapes.split(","):
                got, more = bench_shape(
                    (addr, http), shape, sizes, ceil, args.min_reps, args.lat_reps,
                    args.lat_gap_ms * 1e-3, args.busy_poll_us,
                    args.load_answer == "event",
                )  # fmt: skip
                rows += got
                extra |= more
        if any("--ssd-cache-path" in arg for arg in args.server_arg):
            extra |= ssd_counts(http)
        extra["path_race"] = path_race(http)
    finally:
        stop_server(proc)
    del ceil
    if args.bringup_gib:
        extra |= bring_up(4 if args.quick else args.bringup_gib)
    if args.prefill:
        pre = prefill_seconds(10240)
        load = [r for r in rows if r["shape"].startswith("llama") and r["N"] == 640]
        extra["prefill_10k_ms"] = round(1e3 * pre, 1)
        if load:  # 640 blocks x 16 tokens = the same 10K-token prefix
            load_s = load[0]["MiB"] * 2**20 / (load[0]["load_GBps"] * 1e9)
            extra["load_10k_ms"] = round(1e3 * load_s, 2)
            extra["warm_cold_ratio"] = round(pre / load_s, 1)
    print(table(rows, list(rows[0])))
    for key, value in extra.items():
        print(f"{key}: {value}")
    return {"rows": rows, "extra": extra}


if __name__ == "__main__":
    main()
