"""SSD → GPU direct (kvikio into the engine's GPU blocks, gds.gpu_reads)
against SSD → L1 → GPU (SsdTier.load into pinned slots, then the copy kernels'
scatter), on the tier objects directly. Every load is byte-checked on the GPU
against the engine blocks the records were saved from.

Shape: Llama-3.1-8B on vLLM 0.33 (LBNHC, one buffer, layer-major): 32 layers
× 64 KiB pages a block (2 MiB). Destination blocks are zeroed before each
load and differ from the source blocks, so a byte that did not move fails.

    python benchmarks/gds_direct.py --blocks 1,8,64,640 --json out.json
    python benchmarks/gds_direct.py --dry-run   # parse + plan on a CPU host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment  # noqa: E402
from pegaflow.common.keys import namespace_digest  # noqa: E402
from pegaflow.gds import SsdConfig, SsdTier  # noqa: E402
from pegaflow.gds.format import HEADER_BYTES, align_up  # noqa: E402
from pegaflow.gds.gpu_plan import RecordSpans, plan_reads  # noqa: E402

NS = namespace_digest("gds-direct-bench", (32, 65536))
CTAS = 66


def key(i: int) -> bytes:
    return b"gds-direct-%08d" % i


def geometry(base: int, layers: int, page: int, blocks: int) -> KVGeometry:
    return KVGeometry(
        tuple(
            LayerLayout(0, i * blocks * page, blocks, page, (Segment(0, page),))
            for i in range(layers)
        ),
        [base],
    )


class Rig:
    """An engine's KV on the GPU (source blocks 0..n-1 hold random bytes,
    saved to pinned slots and spilled to the SSD tier), the tier, and both
    routes into destination blocks n..2n-1 (shuffled)."""

    def __init__(
        self, tmp: Path, n: int, layers: int = 32, page: int = 64 << 10, **tier_kw: Any
    ) -> None:
        import torch
        from numba import cuda

        from pegaflow import kernels
        from pegaflow.copiers.fetch_back import DeviceFetch
        from pegaflow.gds.gpu_reads import DirectReads

        self.torch, self.n, self.layers, self.page = torch, n, layers, page
        self.k = kernels.backend("cuda")
        self.stream = self.k.stream()
        blocks = 2 * n
        self.kv = torch.empty(layers * blocks * page, dtype=torch.uint8, device="cuda")
        self.kv3 = self.kv.view(layers, blocks, page)
        self.kv3[:, :n] = torch.randint(
            0, 256, (layers, n, page), dtype=torch.uint8, device="cuda"
        )
        base = self.kv.data_ptr()
        self.geo = geometry(base, layers, page, blocks)
        self.slot = self.geo.slot_bytes
        self.regions = [(base, self.kv.numel())]
        self.kvbuf = self.k.wrap(base, self.kv.numel())
        # Pinned, mapped slots: the "save" lands here, the L1 route reads here.
        self.host = cuda.mapped_array(n * self.slot, np.uint8)
        self.hostbuf = self.k.wrap(
            int(self.host.ctypes.data), n * self.slot, mapped=True
        )
        self.slots = np.uint64(self.host.ctypes.data) + np.arange(
            n, dtype=np.uint64
        ) * np.uint64(self.slot)
        self.src = np.arange(n)
        self.dest = n + np.random.default_rng(0).permutation(n)
        self.src_t = torch.as_tensor(self.src, device="cuda")
        self.dest_t = torch.as_tensor(self.dest, device="cuda")
        self.tier = SsdTier(
            SsdConfig(
                paths=(str(tmp / "gds-direct.cache"),),
                capacity_bytes=n * (self.slot + HEADER_BYTES) + (64 << 20),
                show_progress=False,
                queue_blocks=max(64, n),
                **tier_kw,
            )
        )
        self.save_and_spill()
        self.fetch = DeviceFetch(n * self.slot)
        self.direct = DirectReads(self.tier)

    def save_and_spill(self) -> None:
        """The engine's save (GPU blocks -> pinned slots, one kernel launch),
        then every block spilled to the SSD and written."""
        t = self.geo.engine_to_slots(self.src, self.slots, np.arange(self.layers))
        self.k.gather(self.kvbuf, self.hostbuf, t, stream=self.stream, max_blocks=CTAS)
        self.k.synchronize(self.stream)
        for i in range(self.n):
            assert self.tier.spill(NS, key(i), [int(self.slots[i])], self.slot)
        assert self.tier.flush(timeout=600)
        self.host[:] = 0  # the L1 route must read the SSD, not leftovers

    def _clear(self, m: int) -> None:
        self.kv3[:, self.dest_t[:m]] = 0
        self.torch.cuda.synchronize()

    def check(self, m: int, ok: np.ndarray | None = None) -> bool:
        """Destination blocks equal their sources, byte for byte (where ok)."""
        pick = np.arange(m) if ok is None else np.flatnonzero(ok)
        at = self.torch.as_tensor(pick, device="cuda")
        got = self.kv3[:, self.dest_t[at]]
        return bool(self.torch.equal(got, self.kv3[:, self.src_t[at]]))

    def load_direct(self, m: int) -> tuple[float, Any]:
        self._clear(m)
        start = time.perf_counter()
        hashes = [key(i) for i in range(m)]
        res = self.direct.load(
            NS, hashes, self.dest[:m], self.geo, self.regions, self.fetch
        )
        return time.perf_counter() - start, res

    def load_l1(self, m: int) -> tuple[float, np.ndarray]:
        self._clear(m)
        start = time.perf_counter()
        res = self.tier.load(NS, [key(i) for i in range(m)], self.slots[:m], self.slot)
        ok = res.result(timeout=600).ok
        t = self.geo.slots_to_engine(self.slots[:m], self.dest[:m])
        self.k.scatter(self.hostbuf, self.kvbuf, t, stream=self.stream, max_blocks=CTAS)
        self.k.synchronize(self.stream)
        return time.perf_counter() - start, ok

    def disk_ceiling(self, m: int) -> float:
        """One O_DIRECT read of the file span holding the first m records."""
        recs = [self.tier.store.index.get(NS, key(i)) for i in range(m)]
        lo = min(r.offset for r in recs)
        hi = max(r.offset + r.length for r in recs)
        buf = np.empty(hi - lo + 4096, np.uint8)
        view = buf[-buf.ctypes.data % 4096 :][: hi - lo]
        fd = os.open(self.tier.config.paths[0], os.O_RDONLY | os.O_DIRECT)
        try:
            start = time.perf_counter()
            done = 0
            while done < hi - lo:
                done += os.preadv(fd, [memoryview(view[done:])], lo + done)
            return time.perf_counter() - start
        finally:
            os.close(fd)

    def close(self) -> None:
        self.direct.close()
        self.tier.close()


def measure(rig: Rig, counts: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for m in counts:
        times: dict[str, list[float]] = {"direct": [], "l1": [], "disk": []}
        checked = {"direct": True, "l1": True}
        extra: dict[str, float] = {"reads": 0, "read_s": 0.0, "check_s": 0.0}
        for _ in range(reps):  # interleaved: the disk's drift hits both alike
            s, res = rig.load_direct(m)
            times["direct"].append(s)
            checked["direct"] &= bool(res.ok.all()) and rig.check(m)
            extra = {"reads": res.reads, "read_s": res.read_s, "check_s": res.check_s}
            s, ok = rig.load_l1(m)
            times["l1"].append(s)
            checked["l1"] &= bool(ok.all()) and rig.check(m)
            times["disk"].append(rig.disk_ceiling(m))
        nbytes = m * rig.slot
        for route in ("direct", "l1", "disk"):
            med = statistics.median(times[route])
            rows.append(
                {
                    "blocks": m,
                    "route": route,
                    "bytes": nbytes,
                    "median_s": med,
                    "gbps": nbytes / med / 1e9,
                    "checked": checked.get(route, True),
                    **(extra if route == "direct" else {}),
                }
            )
    return rows


def dry_run(counts: list[int], layers: int, page: int) -> None:
    """Plan the largest load against a fake layout: the CPU half, no GPU."""
    n = max(counts)
    geo = geometry(1 << 40, layers, page, 2 * n)
    length = HEADER_BYTES + align_up(geo.slot_bytes)
    spans = RecordSpans(
        np.zeros(n, np.int64),
        np.arange(n, dtype=np.uint64) * np.uint64(length) + np.uint64(4096),
        np.full(n, length, np.uint64),
        np.full(n, geo.slot_bytes, np.uint64),
    )
    start = time.perf_counter()
    plan = plan_reads(spans, n + np.arange(n), geo, [(1 << 40, 2 * n * geo.slot_bytes)])
    ms = (time.perf_counter() - start) * 1e3
    print(
        f"dry run: {n} blocks x {layers} layers planned in {ms:.1f} ms: "
        f"{len(plan)} reads, {len(plan.back)} fetch-back ranges, "
        f"{plan.total_bytes / 2**20:.0f} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="1,8,64,640", help="loads of these many blocks")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-kib", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--backend",
        choices=["posix", "kvikio"],
        default="posix",
        help="the tier's own I/O backend (the L1 route's reads)",
    )
    p.add_argument("--dir", default=None, help="where the cache file goes (a disk)")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="parse and plan only")
    args = p.parse_args(argv)
    counts = sorted(int(x) for x in args.blocks.split(","))
    if min(counts) < 1:
        p.error("--blocks: need counts >= 1")
    page = args.page_kib << 10
    if args.dry_run:
        dry_run(counts, args.layers, page)
        return 0
    from pegaflow.gds import gpu_route

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rig = Rig(Path(tmp), max(counts), args.layers, page, backend=args.backend)
        try:
            mode = rig.tier.mode
            rows = measure(rig, counts, args.reps)
        finally:
            rig.close()
    present = gpu_route.gds_present()
    print(
        f"\nSSD -> GPU, {args.layers} layers x {args.page_kib} KiB a block; "
        f"tier {mode}; GDS present: {present}; median of {args.reps}"
    )
    print(f"{'blocks':>7} {'route':>7} {'ms':>9} {'GB/s':>7} {'checked':>8}")
    for r in rows:
        print(
            f"{r['blocks']:>7} {r['route']:>7} {r['median_s'] * 1e3:>9.2f} "
            f"{r['gbps']:>7.2f} {str(r['checked']):>8}"
        )
    if args.json:
        out = {
            "mode": mode,
            "gds_present": present,
            "layers": args.layers,
            "page_bytes": page,
            "reps": args.reps,
            "rows": rows,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
