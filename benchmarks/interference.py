"""Engine interference for `benchmarks/transfer.py --interference`: the parts
that need no GPU (settings, arguments, rows of the table) and the engine's
compute, a bf16 matmul loop in a second process.

For each server setting (`--copy-path` x `--copy-sm-cap`), transfer.py streams
saves, loads or both of N blocks while this loop runs, and reports the copy
GB/s next to the matmul's slowdown against the loop alone. The loop runs in its
own process, as an engine's compute does: the server's copy kernels and the
engine's kernels then belong to two CUDA contexts, which time-slice on one GPU
(no MPS), while copy engines can overlap another context's kernels.

`auto` (the default) moves kernel copies to copy engines while its own kernel
copy times show the GPU shared (pegaflow.copiers.contention). Its busy window
starts from kernels (the copies-alone window before it ran idle), so it pays
the switch; a second row, "settled", times a window that follows another
busy window of the same length with no pause between them: auto's steady
choice under compute. `dma_share` is the share of the window's copy bytes the
copy engines moved (from the server's /stats; 0 or 1 where a path is forced).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from benchmarks.common import table

CopyPathName = Literal["auto", "kernel", "dma"]
Mode = Literal["save", "load", "both"]
PATHS: tuple[CopyPathName, ...] = ("kernel", "dma", "auto")
MODES: tuple[Mode, ...] = ("save", "load", "both")
DEFAULT_CAP = 66  # the server's --copy-sm-cap default
READY_S = 120.0  # the worker's CUDA start-up and first matmuls
COLUMNS = [
    "setting",
    "mode",
    "window",
    "dma_share",
    "switches",
    "copy_GBps",
    "copy_alone_GBps",
    "copy_ratio",
    "matmul_TFLOPs",
    "matmul_alone_TFLOPs",
    "slowdown_pct",
]


@dataclass(frozen=True, slots=True)
class Setting:
    """One server configuration of the sweep."""

    path: CopyPathName
    sm_cap: int

    @property
    def label(self) -> str:
        return "dma" if self.path == "dma" else f"{self.path}/{self.sm_cap}"

    def server_args(self) -> tuple[str, ...]:
        return ("--copy-path", self.path, "--copy-sm-cap", str(self.sm_cap))


def settings(paths: list[str], caps: list[int]) -> list[Setting]:
    """Kernel-using paths once per SM cap; "dma" once (it uses no SMs)."""
    out = []
    for path in paths:
        if path not in PATHS:
            raise ValueError(f"copy path {path!r}, need one of {PATHS}")
        if path == "dma":
            out.append(Setting("dma", DEFAULT_CAP))
        else:
            out += [Setting(path, cap) for cap in caps]  # type: ignore[arg-type]
    return out


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1: {text!r}")
    return values


def _words(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        words = [w.strip() for w in text.split(",")]
        bad = [w for w in words if w not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad}: need some of {choices}")
        return words

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine interference (--interference)")
    g.add_argument(
        "--interference",
        action="store_true",
        help="instead of the shape table: a bf16 matmul loop in a second "
        "process while copies stream, for each setting below",
    )
    g.add_argument("--copy-sm-caps", type=_ints, default=[16, 33, 66, 132])
    g.add_argument("--copy-paths", type=_words(PATHS), default=list(PATHS))
    g.add_argument("--interference-modes", type=_words(MODES), default=list(MODES))
    g.add_argument("--interference-blocks", type=int, default=640)
    g.add_argument("--interference-s", type=float, default=2.0)
    g.add_argument("--matmul-n", type=int, default=8192)


def overlap_bytes(
    ops: list[tuple[float, float]], nbytes: int, t0: float, t1: float
) -> float:
    """Bytes of ops (start, end) moved inside [t0, t1], each pro rata."""
    moved = 0.0
    for start, end in ops:
        inside = min(end, t1) - max(start, t0)
        if inside > 0:
            moved += nbytes * inside / max(end - start, 1e-12)
    return moved


def row(
    setting: Setting,
    mode: str,
    m: dict[str, float],
    n_matmul: int,
    window: str = "from idle",
) -> dict:
    """One table row from one measurement: `m` holds copy_GBps (with the
    matmul running), copy_alone_GBps, ceiling_GBps (one direction's pinned
    copy; twice that for "both", which overstates what PCIe gives both ways),
    matmul_per_s and matmul_alone_per_s; for auto also dma_share and
    switches over the busy window (from /stats, see path_counts)."""
    tflop = 2 * n_matmul**3 / 1e12
    alone, busy = m["matmul_alone_per_s"], m["matmul_per_s"]
    forced = {"kernel": 0.0, "dma": 1.0}.get(setting.path)
    return dict(
        setting=setting.label,
        path=setting.path,
        sm_cap=setting.sm_cap,
        mode=mode,
        window=window,
        dma_share=forced if forced is not None else m.get("dma_share"),
        switches=int(m.get("switches", 0)),
        copy_GBps=round(m["copy_GBps"], 1),
        copy_alone_GBps=round(m["copy_alone_GBps"], 1),
        ceiling_GBps=round(m["ceiling_GBps"], 1),
        copy_ratio=round(m["copy_GBps"] / m["ceiling_GBps"], 2),
        matmul_TFLOPs=round(busy * tflop, 1),
        matmul_alone_TFLOPs=round(alone * tflop, 1),
        slowdown_pct=round(100 * (1 - busy / alone), 1) if alone > 0 else None,
    )


def copy_path_gpu0(http: str) -> dict | None:
    """GPU 0's `copy_path` report from the server's /stats; None where the
    policy is a forced path (it reports no devices)."""
    with urllib.request.urlopen(f"http://{http}/stats", timeout=10) as r:
        doc = json.load(r)
    return ((doc.get("copy_path") or {}).get("devices") or {}).get("0")


def path_counts(http: str) -> dict[str, int]:
    """GPU 0's bytes by path and switches so far, from the server's /stats
    (zeros where the policy is a forced path: it counts nothing)."""
    gpu = copy_path_gpu0(http)
    if gpu is None:
        return {"kernel": 0, "dma": 0, "switches": 0}
    switches = gpu["switches_to_dma"] + gpu["switches_to_kernel"]
    return {**gpu["bytes"], "switches": switches}


def path_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """dma_share (None when nothing moved) and switches between two counts."""
    kernel, dma = (after[p] - before[p] for p in ("kernel", "dma"))
    share = round(dma / (kernel + dma), 2) if kernel + dma else None
    return {"dma_share": share, "switches": after["switches"] - before["switches"]}


def _loop(conn: Any, n: int) -> None:
    """The worker: answers each `seconds` with matmuls per second; None ends."""
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in "ab")
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize()
    conn.send("ready")
    while (seconds := conn.recv()) is not None:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(4):
                c = a @ b
            torch.cuda.synchronize()  # completed work only
            count += 4
        conn.send(count / (time.perf_counter() - start))
    del c


class Matmul:
    """The engine's compute, in a second process (spawned: CUDA needs it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_loop, args=(child, n), daemon=True)
        self._proc.start()
        self._recv(READY_S)

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            self.close()
            raise RuntimeError(f"matmul worker silent for {timeout:g} s")
        return self._conn.recv()

    def rate(self, seconds: float) -> float:
        """Matmuls per second over a window of `seconds`."""
        self._conn.send(seconds)
        return float(self._recv(seconds + READY_S))

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


# -- the GPU run (transfer.py's Engine, imported here: transfer imports us) ----
def copy_window(
    eng: Any,
    mode: str,
    n: int,
    seconds: float,
    during: Any = None,
    before: Any = None,
) -> tuple[float, Any]:
    """Saves / loads / both of n random blocks streaming from one thread each;
    over the window (`during()` when given, else `seconds`), the GB/s they
    moved (each copy counted pro rata inside it) and what `during` returned.
    `before()`, when given, runs while they already stream, untimed."""
    src, dst = eng.ids(n, False)
    kept = [secrets.token_bytes(32) for _ in range(n)]
    eng.save(src, kept)
    nbytes = n * eng.layers * eng.page
    threads_of = {"save": 1, "load": 1, "both": 2}
    stop, started = threading.Event(), threading.Barrier(threads_of[mode] + 1)
    ops: list[tuple[float, float]] = []

    def saves() -> None:
        started.wait()
        while not stop.is_set():
            t = time.perf_counter()
            eng.save(src, [secrets.token_bytes(32) for _ in range(n)])
            ops.append((t, time.perf_counter()))

    def loads() -> None:
        started.wait()
        while not stop.is_set():
            hit = eng.client.query(eng.name, kept)
            t = time.perf_counter()
            eng.client.load(eng.name, hit.lease_id, dst)
            ops.append((t, time.perf_counter()))

    work = {"save": [saves], "load": [loads], "both": [saves, loads]}[mode]
    threads = [threading.Thread(target=f) for f in work]
    for thread in threads:
        thread.start()
    started.wait()
    if before is not None:
        before()
    t0 = time.perf_counter()
    got = during() if during else stop.wait(seconds)
    t1 = time.perf_counter()
    stop.set()
    for thread in threads:
        thread.join()
    moved = overlap_bytes(ops, nbytes, t0, t1)
    return moved / (t1 - t0) / 1e9, got


def busy_window(
    eng: Any, mode: str, n: int, secs: float, matmul: Any, settle: bool
) -> dict[str, float]:
    """Copies while the matmul runs: their GB/s, the matmul's rate, and the
    server's dma_share and switches over the timed window. settle: after a
    first untimed busy window (auto's steady choice)."""
    counts: dict[str, int] = {}

    def before() -> None:
        if settle:
            matmul.rate(secs)
        counts.update(path_counts(eng.http))  # as the timed window opens

    busy, matmul_busy = copy_window(
        eng, mode, n, secs, lambda: matmul.rate(secs), before
    )
    after = path_counts(eng.http)
    return dict(copy_GBps=busy, matmul_per_s=matmul_busy, **path_delta(counts, after))


def measure_setting(
    setting: Setting, args: argparse.Namespace, matmul: Any, ceil: dict
) -> list[dict]:
    """One server with this setting: for each mode, copies alone, the matmul
    alone, then both at once; every copy kind byte-checked first."""
    from benchmarks.transfer import Engine, ceiling_gbps, start_server, stop_server

    n, secs = args.interference_blocks, args.interference_s
    proc, addr, http = start_server("16gb", *setting.server_args())
    rows = []
    try:
        eng = Engine(addr, http, "interference", 32, 64 << 10, n)
        ok = eng.checked_round_trip(*eng.ids(n, False))
        nbytes = n * eng.layers * eng.page
        if nbytes not in ceil:
            ceil[nbytes] = ceiling_gbps(ceil["pinned"], eng.buf, nbytes)
        for mode in args.interference_modes:
            counts = path_counts(http)
            alone, _ = copy_window(eng, mode, n, secs)
            alone_share = path_delta(counts, path_counts(http))["dma_share"]
            matmul_alone = matmul.rate(secs)
            windows = ["from idle"] + (["settled"] if setting.path == "auto" else [])
            for window in windows:
                m = busy_window(eng, mode, n, secs, matmul, window == "settled")
                m |= dict(
                    copy_alone_GBps=alone,
                    ceiling_GBps=ceil[nbytes] * (2 if mode == "both" else 1),
                    matmul_alone_per_s=matmul_alone,
                )
                rows.append(row(setting, mode, m, matmul.n, window))
                rows[-1] |= {"bytes_ok": ok, "alone_dma_share": alone_share}
                print(rows[-1], flush=True)
        # every path this setting took under load, byte-checked once more
        rows[-1]["bytes_ok_after"] = eng.checked_round_trip(*eng.ids(n, False))
        eng.close()
    finally:
        stop_server(proc)
    return rows


def payload(args: argparse.Namespace, rows: list[dict], complete: bool) -> dict:
    return {
        "rows": rows,
        "complete": complete,
        "blocks": args.interference_blocks,
        "window_s": args.interference_s,
        "matmul_n": args.matmul_n,
    }


def run(args: argparse.Namespace, checkpoint: Callable[[dict], object]) -> dict:
    """The sweep; `checkpoint` gets the rows so far after each setting (a
    stage limit that cuts the run short keeps them)."""
    import torch

    sweep = settings(args.copy_paths, args.copy_sm_caps)
    ceil = {"pinned": torch.empty(2 << 30, dtype=torch.int8, pin_memory=True)}
    matmul = Matmul(args.matmul_n)
    rows: list[dict] = []
    try:
        for setting in sweep:
            rows += measure_setting(setting, args, matmul, ceil)
            checkpoint(payload(args, rows, False))
    finally:
        matmul.close()
    print(table(rows, COLUMNS))
    return payload(args, rows, True)
