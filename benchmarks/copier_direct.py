"""Where a batch's time goes between the bare kernel and the server's copy
(issue 12): the same N blocks moved by the block kernel alone, by the
server's CudaCopyEngine on the calling thread, and by it on a copy thread
(as the server calls it), into a pool made like kernel_variants.py's and into
one made like the server's (pegaflow.cache.pool.HostPool + HostRegistrar).

On the H200 (2026-12-02, sixth session) the server's copy of 64 blocks ran at
42 GB/s while kernel_variants.py's kernel reached 46-50 on the same shape:
this tells the copier's host work, the thread hop and the pool's memory
apart. Every path's last repetition lands on a poisoned destination and is
checked byte for byte. A GPU host only.

    PYTHONPATH=$PWD python3 benchmarks/copier_direct.py --json $OUT/copier.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from benchmarks import kernel_variants_paths as paths  # noqa: E402
from benchmarks.common import table, write_json  # noqa: E402

SIZES = (1, 64, 640)
POISON = 0xAB


class ServerPool:
    """A pool as the server builds it, with kernel_variants' Mem interface
    for the pieces this benchmark uses (slot addresses, checks, poison)."""

    def __init__(self, gib: int, slot_bytes: int) -> None:
        from pegaflow.cache.pool import HostPool
        from pegaflow.common.cuda_driver import HostRegistrar
        from pegaflow.common.settings import PoolConfig

        config = PoolConfig(size_bytes=gib << 30, show_progress=False)
        self.pool = HostPool(config, HostRegistrar(0, threads=4))
        self.slot_bytes = slot_bytes
        self.slots = self.pool.size // slot_bytes
        self.base = self.pool.base

    def view(self, slots: np.ndarray) -> np.ndarray:
        a = self.pool.array[: self.slots * self.slot_bytes]
        return a.reshape(self.slots, self.slot_bytes)[slots]

    def poison(self, slots: np.ndarray) -> None:
        a = self.pool.array[: self.slots * self.slot_bytes]
        a.reshape(self.slots, self.slot_bytes)[slots] = POISON


def copier_for(base: int, size: int) -> Any:
    from pegaflow.common.settings import CudaConfig
    from pegaflow.copiers.contention import ContendedPolicy
    from pegaflow.copiers.cuda_copier import CudaCopyEngine

    config = CudaConfig()
    return CudaCopyEngine(
        base, size, [0], config.max_ctas, 10.0, ContendedPolicy.from_config(config)
    )


def regions_of(copier: Any, k: Any, address: int, size: int) -> Any:
    """CudaRegions over this process's own allocation (no IPC: same process)."""
    from pegaflow.copiers.cuda_copier import CudaRegions

    dev = next(iter(copier._devices.values()))
    return CudaRegions(dev, (), (address,), k.wrap(address, size), ())


def timed(call: Callable[[], None], reps: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--server-pool-gib", type=int, default=16)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--pools", default="bench pool,server pool")
    ap.add_argument("--paths", default="", help="path names, ; between (default all)")
    args = ap.parse_args(argv)
    sizes = tuple(int(x) for x in args.sizes.split(","))
    import torch

    r = paths.open_run(False, time.monotonic() + 600)
    m, k = r.mem, r.k
    page_rows = m.shape.layers
    server = ServerPool(args.server_pool_gib, m.slot_bytes)
    eng_ptr, eng_size = m.engine.data_ptr(), m.engine.numel()
    back_ptr = m.back.data_ptr()
    pools = {
        "bench pool": (m.pool.address, m.pool.nbytes, m.shape.slots),
        "server pool": (server.base, server.slots * m.slot_bytes, server.slots),
    }
    copiers = {name: copier_for(base, size) for name, (base, size, _) in pools.items()}
    threads = ThreadPoolExecutor(1)
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(3)
    engine_host = m.engine.view(page_rows, m.shape.blocks, m.shape.page).cpu()
    for pool_name, (base, _, nslots) in pools.items():
        if pool_name not in args.pools.split(","):
            continue
        copier = copiers[pool_name]
        pool_buf = copier._devices[next(iter(copier._devices))].pool
        reg_eng = regions_of(copier, k, eng_ptr, eng_size)
        reg_back = regions_of(copier, k, back_ptr, eng_size)
        for n in sizes:
            ids = rng.choice(m.shape.blocks, n, replace=False)
            slots = rng.choice(nslots, n, replace=False)
            addrs = np.uint64(base) + slots.astype(np.uint64) * np.uint64(m.slot_bytes)
            ts = m.geo.engine_to_slots(ids, addrs, np.arange(page_rows))
            tl = m.geo_back.slots_to_engine(addrs, ids)
            calls = path_calls(r, copier, threads, pool_buf, ts, tl, reg_eng, reg_back)
            nbytes = n * m.slot_bytes
            reps = 300 if n == 1 else 60 if n <= 64 else 8
            for direction, by_path in calls.items():
                for name, call in by_path.items():
                    if args.paths and name not in args.paths.split(";"):
                        continue
                    med = timed(call, reps)
                    ok = check(direction, call, m, server, pool_name, base, ids,
                               slots, engine_host, torch)  # fmt: skip
                    row = {"pool": pool_name, "dir": direction, "N": n, "path": name,
                           "us": round(med * 1e6, 1),
                           "GBps": round(nbytes / med / 1e9, 2), "ok": ok}  # fmt: skip
                    rows.append(row)
                    print(row, flush=True)
    idle = cpuidle()
    print("cpuidle:", "; ".join(idle))
    meta = {**paths.versions(False), "pool_gib": args.server_pool_gib, "cpuidle": idle}
    if args.json:
        write_json("copier_direct", {"meta": meta, "rows": rows}, str(args.json))
    print(table(rows, ["pool", "dir", "N", "path", "us", "GBps", "ok"]))
    bad = [x for x in rows if not x["ok"]]
    print(f"FAILED: {len(bad)} rows" if bad else "bytes ok: every row")
    return 1 if bad else 0


def path_calls(
    r: Any, copier: Any, threads: ThreadPoolExecutor, pool_buf: Any, ts: Any,
    tl: Any, reg_eng: Any, reg_back: Any,
) -> dict[str, dict[str, Callable[[], None]]]:  # fmt: skip
    """Per direction: the bare kernel (capped as the server caps it), the
    copier on this thread, the copier on a copy thread."""
    k, m = r.k, r.mem

    def kernel_save() -> None:
        k.gather(m.eng, pool_buf, ts, stream=r.s, max_blocks=66)
        k.synchronize(r.s)

    def kernel_load() -> None:
        k.scatter(pool_buf, m.eng_back, tl, stream=r.s2, max_blocks=66)
        k.synchronize(r.s2)

    out = {}
    for direction, kernel, fn, args in (
        ("save", kernel_save, copier.gather, (reg_eng, ts)),
        ("load", kernel_load, copier.scatter, (reg_back, tl)),
    ):
        out[direction] = {
            "kernel alone, cap 66": kernel,
            "copier, this thread": lambda fn=fn, args=args: fn(*args),
            "copier, copy thread": lambda fn=fn, args=args: threads.submit(
                fn, *args
            ).result(),
            "copy thread, caller spins": lambda fn=fn, args=args: spin(
                threads.submit(fn, *args)
            ),
            "asyncio.to_thread (server)": lambda fn=fn, args=args: (
                LOOP.run_until_complete(asyncio.to_thread(fn, *args))
            ),
            "to_thread, switch interval 0.1 ms": lambda fn=fn, args=args: fast_switch(
                lambda: LOOP.run_until_complete(asyncio.to_thread(fn, *args))
            ),
            "to_thread, wake 200 us early": lambda fn=fn, args=args: (
                LOOP.run_until_complete(wake_early(fn, *args))
            ),
        }
    return out


LOOP = asyncio.new_event_loop()


def fast_switch(call: Callable[[], None]) -> None:
    """A thread waiting for the GIL asks its holder to drop it after the
    switch interval (5 ms by default): shortened here for one call."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        call()
    finally:
        sys.setswitchinterval(old)


def spin(future: Any) -> None:
    while not future.done():
        time.sleep(0)  # drops the GIL: the copy thread's Python must run
    future.result()


EXPECT_GBPS = 48.0  # the copier's rate here at N >= 64 (call 3)
EARLY_S, SPIN_BOUND_S = 200e-6, 1e-3
WAKE_POOL = ThreadPoolExecutor(1)


async def wake_early(fn: Callable[..., None], regions: Any, t: Any) -> None:
    """The loop sleeps until shortly before the copy should end, then polls
    (dropping the GIL each turn) so it is awake when the copy thread ends."""
    future = WAKE_POOL.submit(fn, regions, t)  # polled: not an asyncio future
    expect = 50e-6 + t.total_bytes / (EXPECT_GBPS * 1e9)
    if expect > EARLY_S:
        await asyncio.sleep(expect - EARLY_S)
    bound = time.perf_counter() + SPIN_BOUND_S
    while not future.done() and time.perf_counter() < bound:
        time.sleep(0)
    await asyncio.wrap_future(future)


def cpuidle() -> list[str]:
    """This host's idle states and their exit latencies (the waker's cost)."""
    out = []
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cpuidle").glob("state*")):
        try:
            name = (d / "name").read_text().strip()
            lat = (d / "latency").read_text().strip()
            off = (d / "disable").read_text().strip()
            out.append(f"{name}: exit {lat} us{' (disabled)' if off == '1' else ''}")
        except OSError as exc:
            out.append(f"{d.name}: {exc}")
    gov = Path("/sys/devices/system/cpu/cpuidle/current_governor_ro")
    if gov.exists():
        out.append(f"governor {gov.read_text().strip()}")
    return out or ["no cpuidle states exposed"]


def check(
    direction: str, call: Callable[[], None], m: Any, server: ServerPool,
    pool_name: str, base: int, ids: np.ndarray, slots: np.ndarray,
    engine_host: Any, torch: Any,
) -> bool:  # fmt: skip
    """Poison the destination, run once more, compare every byte."""
    layers, page = m.shape.layers, m.shape.page
    if direction == "save":
        if pool_name == "server pool":
            server.poison(slots)
        else:
            m.poison_pool()
        call()
        torch.cuda.synchronize()
        if pool_name == "server pool":
            got = server.view(slots).reshape(len(slots), layers, page)
        else:
            got = m.pool_v()[torch.as_tensor(slots, device="cuda")].cpu().numpy()
        want = engine_host[:, ids].swapaxes(0, 1).numpy().view(np.uint8)
        return bool((got.view(np.uint8) == want).all())
    m.poison_back()
    call()
    torch.cuda.synchronize()
    back = m.back.view(layers, m.shape.blocks, page).cpu().numpy().view(np.uint8)
    if pool_name == "server pool":
        src = server.view(slots).reshape(len(slots), layers, page)
    else:
        src = m.pool_v()[torch.as_tensor(slots, device="cuda")].cpu().numpy()
    return bool((back[:, ids].swapaxes(0, 1) == src.view(np.uint8)).all())


if __name__ == "__main__":
    sys.exit(main())
