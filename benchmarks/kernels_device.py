"""GPU data path: gather (save) and scatter (load) of Llama-3.1-8B KV pages.

32 layers x 64 KiB pages, LBNHC in one int8 torch CUDA buffer (vLLM 0.33), and
a pool of 2 MiB slots in mmap'd memory registered mapped (as pegaflow's pool).
For N random blocks -> N random slots it times pegaflow.kernels.cuda zero-copy
(16- and 8-byte stores, full and capped grids) and staged, beside one pinned
cudaMemcpy of the same bytes (the ceiling), torch index_select + one copy, and
one cudaMemcpyAsync per page; then both directions at once. Every variant is
byte-checked once (poisoned destination, untouched bytes included) before it
is timed. Times are wall clock per call, Python planning included.

    PYTHONPATH=$PWD python3 benchmarks/kernels_device.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from cuda.bindings import driver, runtime  # noqa: E402

from pegaflow import kernels  # noqa: E402
from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment, Transfers  # noqa: E402

LAYERS, PAGE = 32, 64 << 10
ENGINE_BLOCKS, POOL_SLOTS = 4096, 3072
SIZES = (16, 64, 640, 2560)
STAGING = 256 << 20
PER_PAGE_MAX = 640  # one Python call per page: too slow beyond
POISON = -85  # 0xAB as int8


def layout() -> tuple[LayerLayout, ...]:
    return tuple(
        LayerLayout(
            0, i * ENGINE_BLOCKS * PAGE, ENGINE_BLOCKS, PAGE, (Segment(0, PAGE),)
        )
        for i in range(LAYERS)
    )


def check(result: tuple) -> None:
    if int(result[0]) != 0:
        raise RuntimeError(f"CUDA error {result[0]}")


class Bench:
    def __init__(self) -> None:
        self.k = kernels.backend("cuda")
        shape = (LAYERS * ENGINE_BLOCKS * PAGE,)
        self.engine = torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")
        self.back = torch.empty_like(self.engine)  # scatter destination
        self.geo = KVGeometry(layout(), [self.engine.data_ptr()])
        self.geo_back = KVGeometry(layout(), [self.back.data_ptr()])
        size = POOL_SLOTS * self.geo.slot_bytes
        self.mem = mmap.mmap(-1, size)
        host = np.frombuffer(self.mem, np.uint8)
        host[::4096] = 0  # fault every page in before registering
        flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
        check(runtime.cudaHostRegister(host.ctypes.data, size, flags))
        self.pool_t = torch.from_numpy(host).view(torch.int8)
        self.pool = self.k.wrap(host.ctypes.data, size, mapped=True, owner=host)
        self.eng = self.k.wrap_array(self.engine)
        self.eng_back = self.k.wrap_array(self.back)
        self.stream = self.k.stream()
        self.stream2 = self.k.stream()
        self.staging = self.k.staging_buffer(STAGING)
        self.rng = np.random.default_rng(0)

    def pick(self, n: int, contiguous: bool = False) -> tuple[np.ndarray, np.ndarray]:
        ids = self.rng.choice(ENGINE_BLOCKS, n, replace=False)
        slots = np.arange(n) if contiguous else self.rng.choice(POOL_SLOTS, n, False)
        return ids, slots

    def save_t(self, ids: np.ndarray, slots: np.ndarray) -> Transfers:
        addrs = self.pool.address + slots * self.geo.slot_bytes
        return self.geo.engine_to_slots(ids, addrs, np.arange(LAYERS))

    def load_t(self, ids: np.ndarray, slots: np.ndarray) -> Transfers:
        addrs = self.pool.address + slots * self.geo.slot_bytes
        return self.geo_back.slots_to_engine(addrs, ids)

    # -- byte checks (on the GPU: the pool is copied over once) ------------------
    def poison_pool(self) -> None:
        torch.cuda.synchronize()
        n = self.pool.nbytes
        dev = driver.CUdeviceptr(self.pool.device_address)
        check(driver.cuMemsetD8Async(dev, 0xAB, n, driver.CUstream(0)))
        torch.cuda.synchronize()

    def pool_view(self) -> torch.Tensor:
        torch.cuda.synchronize()
        return self.pool_t.cuda().view(POOL_SLOTS, LAYERS, PAGE)

    def check_gather(self, ids: np.ndarray, slots: np.ndarray) -> bool:
        got = self.pool_view()
        want = self.engine.view(LAYERS, ENGINE_BLOCKS, PAGE)[:, ids].transpose(0, 1)
        rest = np.ones(POOL_SLOTS, bool)
        rest[slots] = False
        return bool(torch.equal(got[slots], want) and (got[rest] == POISON).all())

    def check_scatter(self, ids: np.ndarray, slots: np.ndarray) -> bool:
        torch.cuda.synchronize()
        src = self.pool_view()[slots].transpose(0, 1)
        got = self.back.view(LAYERS, ENGINE_BLOCKS, PAGE)
        rest = np.ones(ENGINE_BLOCKS, bool)
        rest[ids] = False
        return bool(torch.equal(got[:, ids], src) and (got[:, rest] == POISON).all())

    def sync(self) -> None:
        self.k.synchronize(self.stream)
        self.k.synchronize(self.stream2)
        torch.cuda.synchronize()


def timed(b: Bench, fn: Callable[[], None], nbytes: int) -> dict:
    reps = 3 if nbytes > 1 << 30 else 10 if nbytes > 100 << 20 else 30
    times = []
    for _ in range(reps):
        b.sync()
        t0 = time.perf_counter()
        fn()
        b.sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"reps": reps, "median_s": med, "gbps": nbytes / med / 1e9}


def per_page(b: Bench, t: Transfers) -> None:
    h = b.stream.handle
    for s, d, n in zip(t.src.tolist(), t.dst.tolist(), t.nbytes.tolist(), strict=True):
        check(driver.cuMemcpyAsync(driver.CUdeviceptr(d), driver.CUdeviceptr(s), n, h))


def variants(b: Bench, op: str, n: int) -> list[tuple[str, Callable, Callable]]:
    """(name, run, byte check) for one direction and size."""
    k, s = b.k, b.stream
    gather = op == "gather"
    ids, slots = b.pick(n)
    cids, cslots = b.pick(n, contiguous=True)
    t = b.save_t(ids, slots) if gather else b.load_t(ids, slots)
    ct = b.save_t(cids, cslots) if gather else b.load_t(cids, cslots)
    zc, staged = (
        (k.gather, k.gather_staged) if gather else (k.scatter, k.scatter_staged)
    )
    src, dst = (b.eng, b.pool) if gather else (b.pool, b.eng_back)
    ok = b.check_gather if gather else b.check_scatter
    nb = n * b.geo.slot_bytes
    ids_t = torch.from_numpy(ids).cuda()
    eng_v = (b.engine if gather else b.back).view(LAYERS, ENGINE_BLOCKS, PAGE)
    pinned = b.pool_t[:nb].view(LAYERS, n, PAGE)

    def torch_copy() -> None:
        if gather:
            pinned.copy_(eng_v.index_select(1, ids_t), non_blocking=True)
        else:
            eng_v.index_copy_(1, ids_t, pinned.to("cuda", non_blocking=True))

    def torch_ok() -> bool:
        return bool(
            torch.equal(
                b.pool_view().view(-1)[:nb].view(LAYERS, n, PAGE),
                eng_v.index_select(1, ids_t),
            )
        )

    def ceiling() -> None:
        to, frm = (
            (b.pool.address, b.engine.data_ptr())
            if gather
            else (b.back.data_ptr(), b.pool.address)
        )
        ptr = driver.CUdeviceptr
        check(driver.cuMemcpyAsync(ptr(to), ptr(frm), nb, s.handle))

    def ceiling_ok() -> bool:
        eng = (b.engine if gather else b.back)[:nb]
        return bool(torch.equal(b.pool_view().view(-1)[:nb], eng))

    out = [
        ("memcpy, 1 pinned copy (ceiling)", ceiling, ceiling_ok),
        ("zero-copy 16B", lambda: zc(src, dst, t, stream=s), lambda: ok(ids, slots)),
        (
            "zero-copy 8B",
            lambda: zc(src, dst, t, stream=s, width=8),
            lambda: ok(ids, slots),
        ),
        (
            "zero-copy 16B cap 132 CTAs",
            lambda: zc(src, dst, t, stream=s, max_blocks=132),
            lambda: ok(ids, slots),
        ),
        (
            "zero-copy 16B cap 32 CTAs",
            lambda: zc(src, dst, t, stream=s, max_blocks=32),
            lambda: ok(ids, slots),
        ),
        (
            "staged, random slots",
            lambda: staged(src, dst, t, b.staging, stream=s),
            lambda: ok(ids, slots),
        ),
        (
            "staged, contiguous slots",
            lambda: staged(src, dst, ct, b.staging, stream=s),
            lambda: ok(cids, cslots),
        ),
        ("torch index_select + 1 copy", torch_copy, torch_ok),
    ]
    if n <= PER_PAGE_MAX:
        out.append(
            ("cudaMemcpyAsync per page", lambda: per_page(b, t), lambda: ok(ids, slots))
        )
    return out


def prepare(b: Bench, op: str) -> None:
    """Poison the destination; a scatter's pool source gets fresh random bytes."""
    if op == "gather":
        b.poison_pool()
    else:
        b.back.fill_(POISON)
        torch.cuda.synchronize()


def run_direction(b: Bench, op: str, rows: list[dict]) -> None:
    if op == "scatter":
        rand = torch.randint(
            -128, 128, (b.pool.nbytes,), dtype=torch.int8, device="cuda"
        )
        b.pool_t.copy_(rand)
        del rand
    for n in SIZES:
        nb = n * b.geo.slot_bytes
        for name, fn, ok in variants(b, op, n):
            prepare(b, op)
            fn()
            b.sync()
            row = {"op": op, "variant": name, "blocks": n, "bytes": nb, "ok": ok()}
            row.update(timed(b, fn, nb))
            rows.append(row)
            print(f"{op:8} {n:5} {name:36} {row['gbps']:6.1f} GB/s ok={row['ok']}")
            assert row["ok"], row


def run_both(b: Bench, rows: list[dict]) -> None:
    """Save and load at once, on two streams (N=640 each, disjoint slots)."""
    k, n = b.k, 640
    ids_a = b.rng.choice(ENGINE_BLOCKS, n, replace=False)
    ids_b = b.rng.choice(ENGINE_BLOCKS, n, replace=False)
    perm = b.rng.permutation(POOL_SLOTS)
    sa, sb = perm[:n], perm[n : 2 * n]
    ta, tb = b.save_t(ids_a, sa), b.load_t(ids_b, sb)
    combos = {
        "zero-copy both, full grids": ({}, {}, False),
        "zero-copy both, 66 CTAs each": ({"max_blocks": 66}, {"max_blocks": 66}, False),
        "zero-copy both, 33 CTAs each": ({"max_blocks": 33}, {"max_blocks": 33}, False),
        "staged save + zero-copy load": ({}, {}, True),
        "staged save + zero-copy load, 66 CTAs each": (
            {"max_blocks": 66},
            {"max_blocks": 66},
            True,
        ),
    }
    for name, (ka, kb, staged_save) in combos.items():

        def fn(ka: dict = ka, kb: dict = kb, staged_save: bool = staged_save) -> None:
            if staged_save:
                k.gather_staged(b.eng, b.pool, ta, b.staging, stream=b.stream, **ka)
            else:
                k.gather(b.eng, b.pool, ta, stream=b.stream, **ka)
            k.scatter(b.pool, b.eng_back, tb, stream=b.stream2, **kb)

        b.back.fill_(POISON)
        fn()
        b.sync()
        pool = b.pool_view()
        want = b.engine.view(LAYERS, ENGINE_BLOCKS, PAGE)[:, ids_a].transpose(0, 1)
        back = b.back.view(LAYERS, ENGINE_BLOCKS, PAGE)[:, ids_b]
        good = torch.equal(pool[sa], want) and torch.equal(
            back, pool[sb].transpose(0, 1)
        )
        nb = 2 * n * b.geo.slot_bytes
        row = {"op": "both", "variant": name, "blocks": n, "bytes": nb, "ok": good}
        row.update(timed(b, fn, nb))
        rows.append(row)
        print(f"both     {n:5} {name:36} {row['gbps']:6.1f} GB/s ok={good}")
        assert good, row


def run_latency(b: Bench, rows: list[dict]) -> None:
    """One block (2 MiB): launch + kernel + sync, as the server would see it."""
    ids, slots = b.pick(1)
    t, lt = b.save_t(ids, slots), b.load_t(ids, slots)
    calls = {
        "gather zero-copy": lambda: b.k.gather(b.eng, b.pool, t, stream=b.stream),
        "scatter zero-copy": lambda: b.k.scatter(
            b.pool, b.eng_back, lt, stream=b.stream
        ),
        "gather staged": lambda: b.k.gather_staged(
            b.eng, b.pool, t, b.staging, stream=b.stream
        ),
    }
    for name, fn in calls.items():
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            fn()
            b.k.synchronize(b.stream)
            times.append(time.perf_counter() - t0)
        us = statistics.median(times) * 1e6
        rows.append({"op": "latency", "variant": name, "blocks": 1, "median_us": us})
        print(f"latency  1 block {name:28} {us:7.1f} us")


def table(rows: list[dict]) -> str:
    lines = []
    for op in ("gather", "scatter"):
        ceil = {
            r["blocks"]: r["gbps"]
            for r in rows
            if r["op"] == op and "ceiling" in r["variant"]
        }
        lines.append(f"\n{op} (GB/s, ratio to the pinned memcpy ceiling)")
        lines.append("| variant | " + " | ".join(f"N={n}" for n in SIZES) + " |")
        lines.append("|---|" + "---|" * len(SIZES))
        names = dict.fromkeys(r["variant"] for r in rows if r["op"] == op)
        for name in names:
            cells = []
            for n in SIZES:
                r = next(
                    (
                        r
                        for r in rows
                        if r["op"] == op and r["variant"] == name and r["blocks"] == n
                    ),
                    None,
                )
                cells.append(
                    "-" if r is None else f"{r['gbps']:.1f} ({r['gbps'] / ceil[n]:.2f})"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("\nboth directions at once, N=640 each way (total GB/s)")
    for r in rows:
        if r["op"] == "both":
            lines.append(f"| {r['variant']} | {r['gbps']:.1f} |")
    lines.append("\nlatency, 1 block x 32 layers (2 MiB), call + sync")
    for r in rows:
        if r["op"] == "latency":
            lines.append(f"| {r['variant']} | {r['median_us']:.0f} us |")
    return "\n".join(lines)


def _us(fn: Callable[..., object], *args: object, reps: int = 200) -> float:
    fn(*args)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - t0) / reps * 1e6


def _gather_sync(b: Bench, t: Transfers) -> None:
    b.k.gather(b.eng, b.pool, t, stream=b.stream)
    b.stream.synchronize()


def profile_overhead(b: Bench) -> None:
    """Where a small call's time goes (us): planning, launch, sync, kernel."""
    import cProfile
    import pstats

    from numba import cuda

    k, s = b.k, b.stream
    kern, rows = k._kernel(), k._default_blocks()
    e0, e1 = cuda.event(), cuda.event()
    a, p = b.eng.device_address, b.pool.device_address
    for n in (1, 16, 64):
        t = b.save_t(*b.pick(n))
        table = kernels.plan.descriptor_table(b.eng, b.pool, t)
        split = kernels.plan.split_table(table, rows, k.MIN_PIECE)
        tab = k._Table(split.shape[1])
        tab.rows[:, : split.shape[1]] = split
        args = (a, p, a, p, tab.ptr, split.shape[1], tab.cap, 16)
        launch = kern[min(split.shape[1], rows), k.THREADS, s]
        launch(*args)
        e0.record(s)
        launch(*args)
        e1.record(s)
        e1.synchronize()
        stats = {
            "plan": _us(kernels.plan.descriptor_table, b.eng, b.pool, t),
            "split": _us(kernels.plan.split_table, table, rows, k.MIN_PIECE),
            "launch": _us(launch, *args, reps=50),
            "sync idle": _us(s.synchronize),
            "gather+sync": _us(_gather_sync, b, t),
            "kernel+launch gpu": cuda.event_elapsed_time(e0, e1) * 1e3,
        }
        s.synchronize()
        print(
            f"overhead N={n} (us): "
            + ", ".join(f"{a} {v:.0f}" for a, v in stats.items())
        )
    t = b.save_t(*b.pick(1))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        _gather_sync(b, t)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--profile", action="store_true", help="small-call overhead only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    b = Bench()
    print(f"setup {time.perf_counter() - t0:.1f} s", flush=True)
    if args.profile:
        profile_overhead(b)
        return
    rows: list[dict] = []
    run_latency(b, rows)
    for op in ("gather", "scatter"):
        run_direction(b, op, rows)
    run_both(b, rows)
    import numba_cuda

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "numba_cuda": getattr(numba_cuda, "__version__", "?"),
        "threads": b.k.THREADS,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "seconds": time.perf_counter() - t0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels_device.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    print(json.dumps(meta))
    print(table(rows))


if __name__ == "__main__":
    main()
