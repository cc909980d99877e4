"""Fetch or recompute without vLLM (issue 31, part 1): time to first token of
prompts whose prefix is only on the server's SSD tier or in its DRAM (L1), for
three policies: the connector's planner (connector/fetch_plan.py, unchanged),
always load (`fetch_planner: off`), never load (prefill the whole prompt).

    PYTHONPATH=$PWD python benchmarks/fetch_planner_gpu.py --out DIR
        [--ssd-backend kvikio] [--tokens 10240] [--prompts 5] [--budget-s 300]
    ... --device cpu --shape tiny      (host KV, a small CPU model: a smoke run)

This process plays the engine: KV registered with a real pegaflow-server as
benchmarks/transfer.py's Engine does (CUDA IPC; on CPU host memory backed by
a memfd, as the connector does), and a prefill of its own (random weights,
benchmarks/transfer_extras.py's Llama-3.1-8B math; a tail after a loaded
prefix attends to that prefix). Its prefill rate, timed first, is fed to the
planner, as are later prefills the connector's forward timer would time.

A prompt's first token = query (for a pull: polling until it lands or the
planner gives up) + load of the hit + prefill of the rest, synced. The SSD
set: 2P+1 prefixes (a warm-up one that makes the server's SSD and L1 rates
known, P for the planner, P for always-load: a block one policy pulled stays
in L1, so each gets its own), saved, written through to the SSD, then the
server is SIGKILLed and restarted on the same SSD file without a pool file.
The L1 set: P prefixes saved after the restart, served to both loading
policies (a load leaves them where they are). Never-load queries nothing, so
its two sets are the same work. Every load is byte-checked outside the
timing (random bytes, distinct per prefix; the target blocks zeroed before).
A pull the planner declined is waited out before the next prompt, so each
prompt starts with the server idle. Medians. Into --out: the JSON and the
server logs; the SSD file goes to --ssd-dir (a temp dir there, removed).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import transfer_extras as te  # noqa: E402
from benchmarks.common import metric_totals, table, write_json  # noqa: E402
from connector.fetch_plan import FetchPlanner  # noqa: E402
from connector.forward_timer import MIN_STEP_TOKENS  # noqa: E402
from pegaflow.client.kv_layouts import describe, vllm_layer_views  # noqa: E402
from pegaflow.client.pegaflow_client import PegaflowClient  # noqa: E402
from tests.procs import ServerProc, start_server  # noqa: E402

BLOCK = 16  # tokens per block (vLLM's GPU default)
WAIT_S = 120.0  # the longest one pull may take
POLICIES = ("planner", "always", "never")


Shape = namedtuple("Shape", "hidden layers heads kv_heads head ffn vocab")
SHAPES = {
    "llama-3.1-8b": Shape(
        te.HIDDEN, te.LAYERS, te.HEADS, te.KV_HEADS, te.HEAD, te.FFN, te.VOCAB
    ),
    "tiny": Shape(256, 4, 4, 2, 64, 768, 4096),
}


class Model:
    """A forward pass over `tokens` new tokens after `past` cached ones, to the
    first token seen by the host (transfer_extras.prefill_seconds' math)."""

    def __init__(self, s: Shape, device: str, max_tokens: int) -> None:
        self.s, self.dev = s, device
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        kvd, qd, d = s.kv_heads * s.head, s.heads * s.head, s.hidden
        dims = dict(q=(d, qd), k=(d, kvd), v=(d, kvd), o=(qd, d))
        dims |= dict(gate=(d, s.ffn), up=(d, s.ffn), down=(s.ffn, d))

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(shape, device=device, dtype=dt) * 0.02

        self.w = [{n: rand(*x) for n, x in dims.items()} for _ in range(s.layers)]
        self.embed = rand(s.vocab, d)
        # The prefix's K and V as attention reads them (their values: irrelevant).
        self.past_kv = [rand(1, s.heads, max_tokens, s.head) for _ in "kv"]
        pos = torch.arange(max_tokens, device=device, dtype=torch.float32)[:, None]
        inv = 500000.0 ** (-torch.arange(0, s.head, 2, device=device) / s.head)
        self.cos, self.sin = (f(pos * inv).to(dt) for f in (torch.cos, torch.sin))

    @torch.inference_mode()
    def __call__(self, tokens: int, past: int = 0) -> None:
        s, end = self.s, past + tokens
        cos, sin = self.cos[past:end], self.sin[past:end]
        mask = None  # a whole prompt: causal; a tail sees the prefix too
        if past:
            mask = torch.ones(tokens, end, dtype=torch.bool, device=self.dev)
            mask = mask.tril(past)
        h = self.embed[torch.randint(0, s.vocab, (tokens,), device=self.dev)]
        for w in self.w:
            x = F.rms_norm(h, (s.hidden,))
            q, k, v = (
                (x @ w[n]).view(1, tokens, -1, s.head).transpose(1, 2) for n in "qkv"
            )
            q, k = te._rope(q, cos, sin), te._rope(k, cos, sin)
            k, v = (z.repeat_interleave(s.heads // s.kv_heads, 1) for z in (k, v))
            if past:  # the prefix's K and V before the new tokens'
                k = torch.cat((self.past_kv[0][:, :, :past], k), 2)
                v = torch.cat((self.past_kv[1][:, :, :past], v), 2)
            a = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=not past
            )
            h += a.transpose(1, 2).reshape(tokens, -1) @ w["o"]
            x = F.rms_norm(h, (s.hidden,))
            h += (F.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]
        (F.rms_norm(h[-1:], (s.hidden,)) @ self.embed.T).argmax().item()


class KV:
    """The engine's KV: layer-major int8 pages as vLLM lays them out (blocks
    [0, src) hold saved prefixes, [src, src + n) take loads), registered
    again with each server (a restart forgets registrations)."""

    def __init__(self, s: Shape, device: str, n: int, elem: int) -> None:
        self.device, self.src = device, n + 64
        self.page = s.kv_heads * BLOCK * 2 * s.head * elem
        self.block_bytes = s.layers * self.page
        blocks = self.src + n
        size = s.layers * blocks * self.page
        self.buf = torch.empty(size, dtype=torch.int8, device=device)
        self.view = self.buf.view(s.layers, blocks, self.page)
        views = vllm_layer_views(self.buf, s.layers, blocks, (self.page,))
        self.dst = torch.arange(self.src, blocks, device=device)
        self.dst_ids = np.arange(self.src, blocks)  # for the client: no GPU sync
        self.client: PegaflowClient | None = None
        self.name, self.shared = "bench", None
        if device == "cuda":
            from pegaflow.client.cuda_export import IpcEvents, export_kv

            self.events, self.kv = IpcEvents(0), export_kv(views)
        else:  # memfd-backed before a byte is written, as the connector does
            from pegaflow.client.host_share import share_memory

            self.mem = describe(views)
            self.shared = share_memory(self.mem.regions)
        self.buf.random_(-128, 128)

    def register(self, addr: str) -> None:
        if self.client is not None:
            self.client.close()
        self.client = c = PegaflowClient(addr, timeout_s=60)
        if self.device == "cuda":
            c.register_cuda(self.name, "ns-bench", self.kv, self.events.handles)
            return
        m = self.mem
        c.register_host(self.name, "ns-bench", os.getpid(), m.regions, m.layers)
        if self.shared is not None:
            c.share_host(self.name, 0, self.shared.fd, self.shared.spans)

    def save(self, src: np.ndarray, hashes: list[bytes]) -> None:
        event = 0
        if self.device == "cuda":  # the server's copy waits for it on the GPU
            event = self.events.record(torch.cuda.current_stream().cuda_stream)
        res = self.client.save(self.name, src, hashes, wait_event=event)
        assert res.stored == len(src), res

    def check(self, src: np.ndarray, n: int) -> bool:
        want = torch.as_tensor(src[:n], device=self.device)
        return bool(torch.equal(self.view[:, self.dst[:n]], self.view[:, want]))


def fetch(
    kv: KV, planner: FetchPlanner, rid: str, hashes: list[bytes], poll_s: float
) -> tuple[Any, int, dict]:
    """As connector/prefix_query.py asks for a part: the answer to load (None:
    recompute it all), the blocks declined, and the rates the server told."""
    declined, rates, until = 0, {}, time.monotonic() + WAIT_S
    while True:
        res = kv.client.query(kv.name, hashes, hash_len=32)
        rates["l1_GBps"] = round(res.l1_gbps, 3)
        if not res.loading:
            break
        rates["ssd_GBps"] = round(res.tier_gbps, 3)
        est = planner.pulling(
            rid, time.monotonic(), res.num_blocks, kv.block_bytes, BLOCK,
            res.tier_gbps, res.l1_gbps,
        )  # fmt: skip
        if est.decision == "load":
            if time.monotonic() > until:
                raise TimeoutError(f"{rid}: still pulling after {WAIT_S} s")
            time.sleep(poll_s)  # the connector asks again at its next step
            continue
        declined = res.num_blocks  # take what L1 holds now, compute the rest
        rates["gave_up"] = est.load_s < est.compute_s  # the pull ran late
        ready = min(res.ready_blocks, len(hashes))
        res = kv.client.query(kv.name, hashes[:ready], hash_len=32) if ready else None
        res = None if res is None or res.loading else res
        break
    planner.forget(rid)
    if res is None or not res.num_blocks:
        return None, declined, rates
    est = planner.ready(res.num_blocks, kv.block_bytes, BLOCK, res.l1_gbps)
    if est.decision == "recompute":
        kv.client.release_lease(res.lease_id)
        return None, declined + res.num_blocks, rates
    return res, declined, rates


def serve(
    policy: str, where: str, kv: KV, model: Model, planner: FetchPlanner,
    prefix: tuple[list[bytes], np.ndarray], tokens: int, poll_s: float,
) -> dict:  # fmt: skip
    hashes, src = prefix
    kv.view[:, kv.dst] = 0
    if kv.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res, declined, rates, rid = None, 0, {}, f"{policy}-{t0}"
    if policy != "never":
        res, declined, rates = fetch(kv, planner, rid, hashes, poll_s)
    t1 = time.perf_counter()
    hit = res.num_blocks if res is not None else 0
    if hit:
        got = kv.client.load(kv.name, res.lease_id, kv.dst_ids[:hit])
        assert got.loaded == hit, got
    t2 = time.perf_counter()
    rest = tokens - hit * BLOCK
    model(rest, hit * BLOCK)
    t3 = time.perf_counter()
    if rest >= MIN_STEP_TOKENS and not hit:  # what the forward timer times
        planner.observe_prefill(rest, t3 - t2)
    ok = kv.check(src, hit) if hit else None
    why = "load" if hit else "gave_up" if rates.pop("gave_up", 0) else "recompute"
    # A declined pull goes on: it lands, untimed, before the next prompt.
    if declined and (late := fetch(kv, FetchPlanner(False), rid, hashes, poll_s)[0]):
        kv.client.release_lease(late.lease_id)
    ms = [round(1e3 * (b - a), 2) for a, b in ((t0, t3), (t0, t1), (t1, t2), (t2, t3))]
    return dict(
        policy=policy, set=where, ttft_ms=ms[0], query_ms=ms[1], load_ms=ms[2],
        prefill_ms=ms[3], decision=why,
        loaded_tokens=hit * BLOCK, declined_tokens=declined * BLOCK,
        prefilled_tokens=rest, bytes_ok=ok, **rates,
    )  # fmt: skip


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        row: dict[str, object] = {"policy": policy}
        for where in ("ssd", "l1"):
            got = [r for r in mine if r["set"] == where]
            ttft = [r["ttft_ms"] for r in got]
            row[f"{where}_ms"] = round(statistics.median(ttft), 1) if ttft else None
            chose = Counter(r["decision"] for r in got)
            row[f"{where}_chose"] = " ".join(f"{k}x{v}" for k, v in chose.items())
        tok = [sum(r[k] for r in mine) for k in ("loaded_tokens", "declined_tokens")]
        row["loaded/declined_tok"] = f"{tok[0]}/{tok[1]}"
        checked = [r["bytes_ok"] for r in mine if r["bytes_ok"] is not None]
        row["loads_byte_equal"] = f"{sum(checked)}/{len(checked)}"
        out.append(row)
    return out


def main() -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="for the JSON and server logs")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shape", choices=list(SHAPES), help="default: by --device")
    ap.add_argument("--tokens", type=int, help="prompt length (10240; cpu: 512)")
    ap.add_argument("--prompts", type=int, default=5, help="P: prompts per set")
    ap.add_argument("--ssd-backend", default="posix", choices=["posix", "kvikio"])
    ap.add_argument(
        "--ssd-gpu-direct", default="off", choices=["auto", "on", "off"],
        help="off: SSD hits come through L1, the pull the planner weighs",
    )  # fmt: skip
    ap.add_argument("--ssd-dir", help="where the SSD file goes (default: a tmp dir)")
    ap.add_argument("--server-arg", action="append", default=[], help="repeatable")
    ap.add_argument("--poll-ms", type=float, default=2.0, help="while pulling")
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args()
    begin, cuda = time.monotonic(), args.device == "cuda"
    deadline = begin + args.budget_s
    shape = SHAPES[args.shape or ("llama-3.1-8b" if cuda else "tiny")]
    tokens, P = args.tokens or (10240 if cuda else 512), args.prompts
    poll = args.poll_ms / 1e3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProc] = []
    tmp = tempfile.TemporaryDirectory(prefix="pegaflow-fpg-", dir=args.ssd_dir)

    def abort() -> None:  # the last resort: nothing outlives the budget
        print("fetch_planner_gpu: over budget; killing the server", flush=True)
        for s in servers:
            s.proc.kill()
        tmp.cleanup()
        os._exit(124)

    watchdog = threading.Timer(args.budget_s + 60, abort)
    watchdog.daemon = True
    watchdog.start()
    n = (tokens - 1) // BLOCK  # vLLM always computes a prompt's last token
    kv = KV(shape, args.device, n, 2 if cuda else 4)
    model = Model(shape, args.device, tokens)
    rng = np.random.default_rng(0)

    def prefixes(k: int) -> list[tuple[list[bytes], np.ndarray]]:
        # Permuted source blocks: each prefix's bytes differ from the others'.
        perm = [rng.permutation(kv.src)[:n] for _ in range(k)]
        return [([secrets.token_bytes(32) for _ in range(n)], p) for p in perm]

    on_ssd, in_l1 = prefixes(2 * P + 1), prefixes(P)
    room = f"{max(256, int((3 * P + 1) * n * kv.block_bytes * 1.25) >> 20)}mb"
    flags = [
        "--pool-size", room, "--log-level", "info", "--ssd-write-on", "seal",
        "--ssd-cache-path", f"{tmp.name}/ssd.bin", "--ssd-cache-capacity", room,
        "--ssd-backend", args.ssd_backend, "--ssd-gpu-direct", args.ssd_gpu_direct,
        # Write-behind must take a whole set at once (past it: dropped).
        "--ssd-queue-blocks", str((2 * P + 1) * n + 64),
        *(["--devices", "0"] if cuda else []), *args.server_arg,
    ]  # fmt: skip

    def up() -> ServerProc:
        left = max(10.0, deadline - time.monotonic())
        servers.append(start_server(out, *flags, timeout=left))  # log into --out
        kv.register(servers[-1].addr)
        return servers[-1]

    def saved(server: ServerProc, batch: list) -> None:
        for hashes, src in batch:
            kv.save(src, hashes)
        while True:  # written through to the SSD, its writers idle again
            m = metric_totals(server.http)
            assert not m.get("pegaflow_ssd_spills_dropped_total"), "SSD queue full"
            if (
                m.get("pegaflow_ssd_written_blocks_total", 0) >= len(batch) * n
                and m.get("pegaflow_ssd_queue_depth", 1) == 0
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"SSD writes of {len(batch) * n} blocks: {m}")
            time.sleep(0.05)

    rows: list[dict] = []
    try:
        server = up()
        saved(server, on_ssd)
        server.stop(signal.SIGKILL)
        server = up()  # the same SSD file; DRAM empty
        health = json.loads(server.get("/health")[1])
        m = metric_totals(server.http)
        assert m["pegaflow_ssd_blocks"] >= len(on_ssd) * n, m
        assert m["pegaflow_resident_blocks"] == 0, m
        saved(server, in_l1)
        planners = {p: FetchPlanner(p == "planner") for p in POLICIES}
        model(tokens)  # warm-up: kernels, allocator
        pre = []
        for _ in range(2):
            t = time.perf_counter()
            model(tokens)
            pre.append(time.perf_counter() - t)
            for planner in planners.values():
                planner.observe_prefill(tokens, pre[-1])
        warm = serve("always", "ssd", kv, model, planners["always"], on_ssd[0],
                     tokens, poll)  # fmt: skip
        assert warm["bytes_ok"], warm
        ssd_sets = {"planner": on_ssd[1 : P + 1], "always": on_ssd[P + 1 :]}
        for policy, planner in planners.items():
            ssd_set = ssd_sets.get(policy, on_ssd[1 : P + 1])
            for pair in zip(ssd_set, in_l1, strict=True):
                if time.monotonic() > deadline - 0.05 * args.budget_s:
                    break
                for where, prefix in zip(("ssd", "l1"), pair, strict=True):
                    rows.append(
                        serve(policy, where, kv, model, planner, prefix, tokens, poll)
                    )
                    print(rows[-1], flush=True)
    finally:
        for s in servers:
            s.stop()
        tmp.cleanup()
        watchdog.cancel()

    summary = summarize(rows)
    told = {k: [r[k] for r in rows if r.get(k)] for k in ("ssd_GBps", "l1_GBps")}
    extra = {
        "prefill_tokens_per_s": round(planners["planner"].prefill_tokens_per_s),
        "prefill_ms": [round(1e3 * t, 1) for t in pre],
        **{f"server_{k}_median": round(statistics.median(v), 3) if v else None
           for k, v in told.items()},
        **{k: health[k] for k in ("ssd_mode", "ssd_gpu_route")},
        "tokens": tokens, "blocks_per_prefix": n, "block_bytes": kv.block_bytes,
        "prompts_served": len(rows), "prompts_planned": 6 * P,
        "seconds": round(time.monotonic() - begin),
    }  # fmt: skip
    print(table(summary, list(summary[0])))
    for key, value in extra.items():
        print(f"{key}: {value}")
    payload = dict(args=vars(args), shape=shape._asdict(), server_flags=flags)
    payload |= dict(warm_up=warm, summary=summary, extra=extra, prompts=rows)
    return write_json("fetch_planner_gpu", payload, f"{out}/fetch_planner_gpu.json")


if __name__ == "__main__":
    print(f"wrote {main()}")
