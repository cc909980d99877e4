"""The ORIGINAL Rust PegaFlow 0.25.1 (pegaflow-llm; pegaflow-llm-cu13 for CUDA 13)
on benchmarks/transfer.py's workload: torch CUDA KV in vLLM 0.33's per-layer
layout (llama-3.1-8b: 32 layers x 64 KiB pages = 2 MiB a block), random block
ids, N = 1, 64, 640: save/load GB/s (medians) and 1-block save/load P50/P90 ms,
beside one pinned cudaMemcpy of the same bytes in the same run (the ceiling).
Each size is byte-checked once: random bytes saved, the source zeroed, loaded
into other zeroed blocks, compared on the GPU. It is driven as its own vLLM
connector (pegaflow/connector/worker.py) drives it: per-layer CudaIPCWrapper
pickles to register_context_batch; save = torch.cuda.synchronize() + save() of
every layer (no event-ordered save exists); load = query_prefetch() for a
lease, then PyLoadState + load() + a spin on is_ready().

    python3 -m pip install --no-deps --target DIR pegaflow_llm_cu13-0.25.1-*.whl
    python3 benchmarks/transfer_original.py --site DIR --out OUTDIR

Its package is also `pegaflow`: ours is never imported, DIR goes first on
sys.path. The script starts DIR/pegaflow/pegaflow-server-py (its log:
OUTDIR/transfer_original_server.log), measures in a child process under a hard
timeout, stops the server, writes OUTDIR/transfer_original.json. --cross-layer:
the original's own default layout instead (one 2 MiB page a block), if vLLM
grants its connector's prefer_cross_layer_blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import secrets
import site
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
import traceback
from ctypes.util import find_library
from glob import glob
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYERS, PAGE = 32, 64 << 10  # llama-3.1-8b: 8 KV heads x 16 tokens x 2 x 128 x bf16
IID, NS, DEV = "bench-orig", "bench-orig-ns", 0
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAST: dict[str, object] = {}  # the call in flight, for the error message
MODES = {
    "lat_save_event_mode": "the original has no event-ordered save: "
    "torch.cuda.synchronize() + save() timed together, as its connector does",
    "lat_save_synced_mode": "synchronize() before the timer, save() timed",
    "lat_load_mode": "PyLoadState() + load() + spin on is_ready() timed; "
    "query_prefetch() before the timer",
    "rows_modes": "save as lat_save_event, load as lat_load; medians",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--site", required=True, help="pip --target dir of the wheel")
    p.add_argument("--out", required=True, help="directory for the JSON and log")
    p.add_argument("--sizes", default="1,64,640", help="comma-separated N blocks")
    p.add_argument("--min-reps", type=int, default=10, help="timed reps per N")
    p.add_argument("--lat-reps", type=int, default=300, help="1-block reps per kind")
    p.add_argument("--budget-s", type=float, default=200, help="no reps added after")
    p.add_argument("--pool-size", default="16gb", help="server --pool-size")
    p.add_argument("--backend", choices=("direct", "kernel"), default="direct")
    p.add_argument("--server-log-level", default="info")
    more = "one more server flag, e.g. --server-arg=--use-hugepages (repeatable)"
    p.add_argument("--server-arg", action="append", default=[], help=more)
    cross = "one block-first ALL_LAYERS tensor (its connector's default layout)"
    p.add_argument("--cross-layer", action="store_true", help=cross)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    return p


def shadows(path: str) -> bool:
    full = Path(path or ".").resolve()
    return full == HERE or (full / "pegaflow").is_dir()


def describe(x: object) -> str:
    if isinstance(x, tuple):
        return f"({', '.join(describe(e) for e in x)})"
    if isinstance(x, list):
        return f"list[{len(x)}]" + (f" of {describe(x[0])}" if x else "")
    if isinstance(x, bytes):
        return f"bytes[{len(x)}]"
    return repr(x) if isinstance(x, str | int | float | bool) else type(x).__name__


def rpc(name: str, fn, *args):
    LAST["call"] = (name, args)  # formatted only on failure: keeps timings clean
    res = fn(*args)
    if isinstance(res, tuple) and len(res) == 2 and res[0] is False:
        raise RuntimeError(f"{last_call()} returned ok=False: {res[1]}")
    return res


def last_call() -> str:
    name, args = LAST.get("call", ("(none)", ()))
    return f"{name}({', '.join(describe(a) for a in args)})"


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def server_env(site_dir: str) -> tuple[dict[str, str], dict[str, object]]:
    """pegaflow/_bin_utils.binary_env() (libpython on LD_LIBRARY_PATH, package
    and site-packages on PYTHONPATH) with DIR first, no path to our package, and
    a libcudart.so of the server's CUDA major: its preflight dlopens one, and
    torch's (site-packages/nvidia/*/lib) is on no default path."""
    build = 13 if glob(f"{site_dir}/pegaflow_llm_cu13-*.dist-info") else 12
    roots = [f"{r}/nvidia/*/lib" for r in (site_dir, *site.getsitepackages())]
    roots += ["/usr/local/cuda*/lib64", "/usr/local/cuda*/targets/x86_64-linux/lib"]
    libs = [d for r in roots for d in sorted(glob(r))
            if glob(f"{d}/libcudart.so.{build}*")][:1]  # fmt: skip
    if not libs:  # pegaflow-llm is built for CUDA 12.8, pegaflow-llm-cu13 for 13.0
        print(f"WARNING: no libcudart.so.{build} found: the server's CUDA preflight "
              "fails unless the system has one", flush=True)  # fmt: skip
    info = {"server_cuda_major": build, "cudart_dir": libs}
    libdir, ver = sysconfig.get_config_var("LIBDIR"), sysconfig.get_python_version()
    if not (glob(f"{libdir}/libpython{ver}.so*") or find_library(f"python{ver}")):
        print(f"WARNING: no libpython{ver}.so: the server links it", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ld = [libdir, *libs, env.get("LD_LIBRARY_PATH")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in ld if p)
    extra = [*env.get("PYTHONPATH", "").split(os.pathsep), *site.getsitepackages()]
    keep = [p for p in extra if p and Path(p).is_dir() and not shadows(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([site_dir, *keep]))
    return env, info


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, binary: Path, env: dict, log: Path, extra: list, deadline):
    """(process, cmd, endpoint) once health() answers ok."""
    port = free_port()
    cmd = [str(binary), "--addr", f"127.0.0.1:{port}", "--http-addr",
           f"127.0.0.1:{free_port()}", "--devices", str(DEV), "--pool-size",
           args.pool_size, "--log-level", args.server_log_level, *extra]  # fmt: skip
    print("server:", *cmd, flush=True)
    with open(log, "ab") as f:  # in our session: a runner killing us kills it
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    from pegaflow.pegaflow import EngineRpcClient

    endpoint, last = f"http://127.0.0.1:{port}", "no answer yet"
    while time.time() < deadline and server.poll() is None:
        try:
            ok, last = EngineRpcClient(endpoint).health()
            if ok:
                return server, cmd, endpoint
        except Exception as e:  # refused while it pins its pool
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    died = server.poll() is not None
    stop(server)
    raise (ChildProcessError if died else TimeoutError)(
        f"rc={server.returncode}, not healthy: {last}"
    )


def stop(server: subprocess.Popen) -> None:
    server.terminate()  # SIGTERM: its graceful shutdown
    try:
        server.wait(8)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(5)


def orchestrate(args: argparse.Namespace, site_dir: str, argv: list[str]) -> int:
    t0, out = time.time(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path, log_path = out / f"{args.name}.json", out / f"{args.name}_server.log"
    path.unlink(missing_ok=True)  # a failed run must not leave the last one's rows
    binary = Path(site_dir, "pegaflow", "pegaflow-server-py")
    if not binary.is_file():
        sys.exit(f"no server binary at {binary}: pip install --target {site_dir} ...")
    env, info = server_env(site_dir)
    print(f"PYTHONPATH={env['PYTHONPATH']}\nLD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}")
    rc, failure, server, cmd = 1, "", None, []
    log_path.write_bytes(b"")
    # One run, no second chance: a start that dies (a NUMA probe, say) is tried
    # once more with --disable-numa-affinity; the JSON's cmd says which ran.
    tries = [args.server_arg, [*args.server_arg, "--disable-numa-affinity"]]
    for extra in tries[: 1 + ("--disable-numa-affinity" not in args.server_arg)]:
        info.setdefault("extra_args_tried", []).append(extra)
        try:
            server, cmd, endpoint = start_server(
                args, binary, env, log_path, extra, t0 + min(120, args.budget_s)
            )
            break
        except (ChildProcessError, TimeoutError) as e:
            failure = f"server start: {e}"
            print(f"FAILED {failure}; log tail:", *tail(log_path), sep="\n")
            if isinstance(e, TimeoutError):  # alive but not healthy: no retry
                break
    if server is not None:
        failure = ""
        print(f"server healthy after {time.time() - t0:.1f} s", flush=True)
        child = subprocess.Popen([sys.executable, __file__, *argv, "--worker",
                                  endpoint, "--t0", repr(t0)], env=env)  # fmt: skip
        try:
            rc = child.wait(timeout=max(5.0, t0 + args.budget_s + 20 - time.time()))
        except subprocess.TimeoutExpired:
            print("TIMEOUT: measuring outran --budget-s + 20 s; killed (its stack "
                  "is printed above)", flush=True)  # fmt: skip
            child.kill()
            child.wait(5)
            rc, failure = 124, "measuring timed out (see its stack in the output)"
        finally:
            stop(server)
        if rc:
            print(f"--- server log tail ({log_path}) ---", *tail(log_path), sep="\n")
    got = json.loads(path.read_text()) if path.is_file() else {"rows": [], "extra": {}}
    rcs = {"rc": server and server.returncode, "worker_rc": rc}
    got["server"] = {"cmd": cmd, **rcs, **info}
    if failure:
        got.setdefault("error", failure)
    write_json(path, got)
    print(f"wrote {path} (rc={rc}, {time.time() - t0:.0f} s)", flush=True)
    return rc


def tail(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-60:]


class Engine:
    """One engine's KV on GPU 0, registered with the original server."""

    def __init__(self, endpoint: str, blocks: int, backend: str, cross: bool) -> None:
        import torch

        from pegaflow import pegaflow as pf
        from pegaflow.ipc_wrapper import CudaIPCWrapper

        self.torch, self.pf, self.blocks, self.req = torch, pf, blocks, 0
        self.buf = torch.randint(-128, 128, (LAYERS * blocks * PAGE,),
                                 dtype=torch.int8, device="cuda")  # fmt: skip
        if cross:  # [blocks, layers x page]; view: the same bytes, layer-major
            self.names, page = ["ALL_LAYERS"], LAYERS * PAGE
            regs = [self.buf.view(blocks, page)]
            self.view = self.buf.view(blocks, LAYERS, PAGE).transpose(0, 1)
        else:  # vLLM 0.33's own: layer-major, a [blocks, page] view per layer
            self.names, page = NAMES, PAGE
            self.view = self.buf.view(LAYERS, blocks, PAGE)
            regs = list(self.view)
        self.client = pf.EngineRpcClient(endpoint)
        try:  # its scheduler side opens this before the workers register
            rpc("start_session_watcher", self.client.start_session_watcher,
                IID, NS, 1, 1)  # fmt: skip
        except Exception as e:
            print(f"note: {last_call()} failed ({e}); going on", flush=True)
        wrappers = [pickle.dumps(CudaIPCWrapper(t)) for t in regs]
        # Each [blocks, page]: blocks-first, bytes_per_block = stride 0, no K/V
        # split: what _infer_kv_cache_registration derives for it.
        k = len(regs)
        rpc("register_context_batch", self.client.register_context_batch,
            IID, NS, 0, 0, 1, 1, DEV, self.names, wrappers, [blocks] * k,
            [page] * k, [0] * k, [1] * k, backend, False, [0] * k)  # fmt: skip

    def save(self, ids: list[int], hashes: list[bytes], sync: bool = True) -> float:
        saves = [(name, ids, hashes) for name in self.names]
        t = time.perf_counter()
        if sync:  # as worker._save_batch does before its save RPC
            self.torch.cuda.synchronize()
        rpc("save", self.client.save, IID, 0, 0, DEV, saves)
        return time.perf_counter() - t

    def lease(self, hashes: list[bytes]) -> tuple[bytes, int]:
        """A lease on all of hashes, and the retries: the server indexes a save
        after answering it, so a query right after may see fewer blocks."""
        self.req += 1
        req, deadline, tries, got = f"bench-{self.req}", time.time() + 10, 0, None
        while time.time() < deadline:
            got = rpc("query_prefetch", self.client.query_prefetch, IID, hashes, req)
            if isinstance(got, self.pf.QueryReady):
                if got.num_hit_blocks == len(hashes):
                    return got.lease, tries
                if got.lease:
                    rpc("release", self.client.release, got.lease)
            tries += 1
            time.sleep(0.0005)
        hit = getattr(got, "num_hit_blocks", type(got).__name__)
        raise RuntimeError(f"query_prefetch: {hit} of {len(hashes)} blocks after "
                           f"{tries} tries (req {req})")  # fmt: skip

    def load(self, ids: list[int], lease: bytes) -> float:
        loads = [(lease, [ids])]
        t = time.perf_counter()
        state = self.pf.PyLoadState()  # one per batch, as start_load_kv makes it
        rpc(
            "load", self.client.load, IID, 0, DEV, state.shm_name(), [self.names], loads
        )
        while not state.is_ready():
            if time.perf_counter() > t + 30:
                raise RuntimeError(f"{last_call()}: PyLoadState not ready in 30 s")
        took = time.perf_counter() - t
        if state.get_state() < 0:
            raise RuntimeError(f"{last_call()}: PyLoadState {state.get_state()}")
        return took

    def checked(self, src: list[int], dst: list[int]) -> tuple[bool, int]:
        torch = self.torch
        s, d = torch.tensor(src, device="cuda"), torch.tensor(dst, device="cuda")
        self.view[:, s] = torch.randint(-128, 128, (LAYERS, len(src), PAGE),
                                        dtype=torch.int8, device="cuda")  # fmt: skip
        want = self.view[:, s]  # advanced indexing: a copy
        self.view[:, d] = 0
        hashes = [secrets.token_bytes(32) for _ in src]
        self.save(src, hashes)
        self.view[:, s] = 0  # a save still reading after it answered shows here
        lease, tries = self.lease(hashes)
        self.load(dst, lease)
        torch.cuda.synchronize()
        return bool(torch.equal(self.view[:, d], want)), tries


def ceiling(torch, pinned, dev, nbytes: int) -> dict[str, float]:
    """Best of 3: one pinned cudaMemcpy each way of nbytes, as transfer.py."""
    best = {"d2h": 0.0, "h2d": 0.0}
    for _ in range(3):
        for way, (to, fro) in (("d2h", (pinned, dev)), ("h2d", (dev, pinned))):
            torch.cuda.synchronize()
            t = time.perf_counter()
            to[:nbytes].copy_(fro[:nbytes], non_blocking=True)
            torch.cuda.synchronize()
            best[way] = max(best[way], nbytes / (time.perf_counter() - t) / 1e9)
    return best


def ms(times: list[float], q: int = 50) -> float:
    at = sorted(times)[round(q / 100 * (len(times) - 1))]
    return round(1e3 * (statistics.median(times) if q == 50 else at), 3)


def measure(args: argparse.Namespace, site_dir: str) -> int:
    import faulthandler

    import numpy as np
    import torch

    import pegaflow

    if not Path(pegaflow.__file__).resolve().is_relative_to(site_dir):
        sys.exit(f"pegaflow came from {pegaflow.__file__}, not {site_dir}")
    # The parent kills a hung run at t0 + budget + 20: say where it hung first.
    faulthandler.dump_traceback_later(
        max(5, args.t0 + args.budget_s + 15 - time.time())
    )
    sizes = [int(x) for x in args.sizes.split(",")]
    out = Path(args.out) / f"{args.name}.json"
    res: dict = {"machine": {"host": platform.node(), "torch": torch.__version__,
                             "gpu": torch.cuda.get_device_name(0),
                             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
                 "original": {"version": pegaflow.__version__, "site": site_dir,
                              "backend": args.backend, "pool": args.pool_size,
                              "cross_layer": args.cross_layer},
                 "rows": [], "extra": {}}  # fmt: skip

    def over() -> bool:
        return time.time() > args.t0 + args.budget_s

    eng, shape = None, "llama-3.1-8b" + "/cross" * args.cross_layer
    try:
        eng = Engine(args.worker, 2 * max(sizes) + 64, args.backend, args.cross_layer)
        pinned = torch.empty(max(sizes) * LAYERS * PAGE, dtype=torch.int8,
                             pin_memory=True)  # fmt: skip
        rng = np.random.default_rng(0)
        for n in sizes:
            perm = (rng.permutation(eng.blocks - 1) + 1).tolist()  # 0: vLLM's null
            src, dst = perm[:n], perm[n : 2 * n]
            ok, retries = eng.checked(src, dst)
            saves, loads = [], []
            for _ in range(max(args.min_reps, min(30, 640 // n))):
                if saves and over():
                    break
                hashes = [secrets.token_bytes(32) for _ in range(n)]
                saves.append(eng.save(src, hashes))
                lease, tries = eng.lease(hashes)
                retries += tries
                loads.append(eng.load(dst, lease))
            nbytes = n * LAYERS * PAGE
            c = ceiling(torch, pinned, eng.buf, nbytes)
            ceil = min(c.values())
            sgb = nbytes / statistics.median(saves) / 1e9
            lgb = nbytes / statistics.median(loads) / 1e9
            res["rows"].append(dict(
                shape=shape, N=n, ids="random", MiB=round(nbytes / 2**20, 1),
                reps=len(saves), save_GBps=round(sgb, 1), load_GBps=round(lgb, 1),
                ceiling_GBps=round(ceil, 1), save_ratio=round(sgb / ceil, 2),
                load_ratio=round(lgb / ceil, 2), d2h_GBps=round(c["d2h"], 1),
                h2d_GBps=round(c["h2d"], 1), bytes_ok=ok, query_retries=retries,
            ))  # fmt: skip
            print(res["rows"][-1], flush=True)
            write_json(out, res)
        res["extra"] = latency(eng, args.lat_reps, over) | {"budget_hit": over()}
    except Exception:
        traceback.print_exc()
        res["error"] = f"{traceback.format_exc(limit=3)}\nlast call: {last_call()}"
        print(f"FAILED in {last_call()}", flush=True)
    finally:
        if eng is not None:
            try:
                rpc("unregister_context", eng.client.unregister_context, IID)
            except Exception as e:
                print(f"note: {last_call()} failed: {e}", flush=True)
        write_json(out, res)
    rows = res["rows"]
    if rows:
        width = {c: max(len(c), *(len(f"{r[c]}") for r in rows)) for c in rows[0]}
        for r in [{c: c for c in rows[0]}, *rows]:
            print(" | ".join(f"{r[c]}".rjust(width[c]) for c in width))
    for key, value in res["extra"].items():
        print(f"{key}: {value}")
    return 1 if "error" in res or not all(r["bytes_ok"] for r in rows) else 0


WARM_REPS = 30  # as benchmarks/transfer.py (not imported: it imports our pegaflow)


def latency(eng: Engine, reps: int, over) -> dict:
    """1 block x 32 layers, call to completion seen here, ms, as transfer.py:
    the three kinds take turns, after WARM_REPS untimed turns."""
    src, dst, out = [3], [eng.blocks - 1], dict(MODES)
    hashes = [secrets.token_bytes(32)]
    eng.save(src, hashes)
    times: dict[str, list[float]] = {"save_event": [], "save_synced": [], "load": []}
    queries: list[float] = []
    turn = 0
    while len(times["load"]) < reps and not (len(times["load"]) >= 20 and over()):
        event = eng.save(src, [secrets.token_bytes(32)], sync=True)
        eng.torch.cuda.synchronize()
        synced = eng.save(src, [secrets.token_bytes(32)], sync=False)
        t = time.perf_counter()
        lease, _ = eng.lease(hashes)
        query = time.perf_counter() - t
        load = eng.load(dst, lease)
        turn += 1
        if turn > WARM_REPS:
            for kind, took in zip(times, (event, synced, load), strict=True):
                times[kind].append(took)
            queries.append(query)
    for kind, got in times.items():
        out |= {f"lat_{kind}_p50_ms": ms(got), f"lat_{kind}_p90_ms": ms(got, 90)}
    return out | {"lat_reps": len(queries), "lat_query_p50_ms": ms(queries)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.name = "transfer_original" + ("-cross" if args.cross_layer else "")
    site_dir = str(Path(args.site).resolve())
    # Ours is also `pegaflow`: nothing that holds one may come before DIR.
    sys.path[:] = [site_dir, *(p for p in sys.path if not shadows(p))]
    if args.worker:
        return measure(args, site_dir)
    return orchestrate(args, site_dir, argv)


if __name__ == "__main__":
    sys.exit(main())
