"""Soak: several engine processes against one server, under eviction pressure
and injected faults, every loaded byte checked.

    python benchmarks/soak.py --seconds 300 --burn-phase-seconds 100
    python benchmarks/soak.py --seconds 60 --burn-phase-seconds 20 \\
        --faults engine-kill,server-kill,server-stop,client-stop --json out.json

Each engine (benchmarks/soak_engine.py, a 'spawn' process with host KV in
numpy) loops: query the chained hashes of a random prompt, load the hit prefix
into other block ids (poisoned first) and compare every byte with the bytes
derived from each block's hash, save the missed rest. The prompts' blocks
(--prompts x --blocks-per-prompt) outnumber what the pool holds, so the pool
evicts all the time. The server's RSS (VmRSS) is sampled twice a second.

The run has two phases: a plain server, then (--burn-phase-seconds, the last
part of --seconds) a server started through a wrapper that runs a pure-Python
thread spinning beside it (GIL contention, no server code changed). Switching
restarts the server on the same port, as a server-kill does.

Faults, one at a time every --fault-every seconds, kinds taken in turn:
  engine-kill  SIGKILL an engine; a new engine process takes its place.
  server-kill  SIGKILL the server; restart it on the same port (empty pool);
               engines notice by failing and re-register on their own.
  server-stop  SIGSTOP the server for --client-timeout + 2 s, then SIGCONT;
               the engines' calls time out and they re-register.
  client-stop  SIGSTOP an engine for --client-stop-seconds, then SIGCONT.

Counted:
  WRONG   a block a load reported as loaded whose bytes differ from its hash's
          bytes. Expected under no fault: must be 0.
  LOST    the blocks of a query's hit (the server said they are resident: some
          engine's save was acknowledged) whose load then raised or loaded fewer
          blocks, while no fault was in progress. Must be 0.
  Expected failures: a call (register, query, save, or a hit's load) that
  fails while a fault overlaps it is expected, counted apart and retried:
  server-kill/server-stop/phase switch: any call of any engine that started
  while the server fault was in progress or overlapped it (a hit's load counts
  from its query), and an engine's calls until its first success after the
  fault (it learns of a restarted server from UnknownInstance or UNAVAILABLE);
  engine-kill/client-stop: the calls of that engine that overlapped its fault.
  Any other failure is counted as unexpected per operation.
Query P50/P99 are over successful queries no fault overlapped, per phase.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import soak_engine as se  # noqa: E402
from benchmarks.common import table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("engine-kill", "server-kill", "server-stop", "client-stop")
READY_TIMEOUT_S = 60.0
# The burn phase's server: a daemon thread spinning in pure Python, then the CLI.
BURN_WRAPPER = (
    "import sys, threading\n"
    "def _burn():\n"
    "    while True:\n"
    "        pass\n"
    "threading.Thread(target=_burn, name='soak-burn', daemon=True).start()\n"
    "from pegaflow.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_rss(pid: int) -> int | None:
    """VmRSS of a process in bytes; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) << 10
    except OSError:
        return None
    return None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    return env


@dataclass
class Server:
    """The server process, restartable on one port."""

    port: int
    pool_size: str
    log_dir: Path
    proc: subprocess.Popen | None = None
    http: str = ""
    burn: bool = False
    starts: int = 0
    evictions: list[float] = field(default_factory=list)  # per incarnation

    def start(self, burn: bool) -> None:
        head = ["-c", BURN_WRAPPER] if burn else ["-m", "pegaflow.cli"]
        argv = [sys.executable, *head, "--addr", f"127.0.0.1:{self.port}"]
        argv += ["--http-addr", "127.0.0.1:0", "--pool-size", self.pool_size]
        argv += ["--no-progress", "--log-level", "warning"]
        log = self.log_dir / f"server-{self.starts}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, env=_env(), cwd=ROOT
            )
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        line = proc.stdout.readline().decode() if ready else ""
        if not line.startswith("READY"):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"server did not start: {line!r}; see {log}")
        fields = dict(part.split("=", 1) for part in line.split()[1:])
        self.proc, self.http, self.burn = proc, fields["http"], burn
        self.starts += 1
        self.evictions.append(0.0)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped one cannot stop
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def scrape_evictions(self, start: int) -> None:
        """The evictions counter of incarnation `start` (1-based), if it answers."""
        http = self.http
        try:
            with urllib.request.urlopen(f"http://{http}/metrics", timeout=5) as r:
                body = r.read().decode()
        except OSError:  # stopped, restarting or gone: keep the last value
            return
        if self.starts != start:  # restarted meanwhile: that answer was the old one's
            return
        for line in body.splitlines():
            if line.startswith("pegaflow_evictions_total "):
                self.evictions[start - 1] = float(line.split()[1])


class Soak:
    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args = args
        self.n = args.engines
        self.ctx = mp.get_context("spawn")
        self.shared = se.Shared(
            counters=self.ctx.RawArray("q", self.n * len(se.COUNTERS)),
            hist=self.ctx.RawArray("q", self.n * len(se.PHASES) * se.BUCKETS),
            gens=self.ctx.RawArray("q", 1 + self.n),
            phase=self.ctx.RawValue("i", 0),
            go=self.ctx.RawValue("i", 0),
            stop=self.ctx.RawValue("i", 0),
        )
        self.server = Server(free_port(), args.pool_size, log_dir)
        self.spec = se.EngineSpec(
            addr=f"127.0.0.1:{self.server.port}",
            namespace="soak",
            prompts=args.prompts,
            blocks_per_prompt=args.blocks_per_prompt,
            engine_blocks=args.engine_blocks,
            timeout_s=args.client_timeout,
            seed=args.seed,
            log_dir=str(log_dir),
        )
        self.engines: list[mp.process.BaseProcess] = []
        self.faults = {kind: 0 for kind in args.faults}
        self.fault_log: list[dict[str, object]] = []
        self.unplanned = {"engine_exits": 0, "server_exits": 0}
        self.rss: list[tuple[float, int, int, int]] = []  # t, phase, start, bytes
        # (phase, when it began, the counters then)
        self.phase_marks: list[tuple[str, float, list[int]]] = []
        self.t0 = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()  # the server object while it restarts

    # -- processes ---------------------------------------------------------------
    def spawn_engine(self, slot: int) -> mp.process.BaseProcess:
        proc = self.ctx.Process(
            target=se.main, args=(slot, self.spec, self.shared), daemon=True
        )
        proc.start()
        return proc

    def counter(self, slot: int, name: str) -> int:
        return self.shared.counters[slot * len(se.COUNTERS) + se.C[name]]

    def wait_registered(self, slot: int, before: int, limit_s: float = 60) -> None:
        deadline = time.monotonic() + limit_s
        while self.counter(slot, "registrations") <= before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {slot} did not register in {limit_s} s")
            time.sleep(0.05)

    def kill_and_restart_server(self) -> None:
        with self._lock:
            self.server.kill()
            self.server.start(self.server.burn)

    def bump(self, index: int) -> None:
        self.shared.gens[index] += 1

    # -- faults ----------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        slot = self.faults[kind] % self.n  # engine faults go round the engines
        began = time.monotonic()
        if kind in ("server-kill", "server-stop"):
            self.bump(0)
            if kind == "server-kill":
                self.kill_and_restart_server()
            else:
                self.server.signal(signal.SIGSTOP)
                time.sleep(self.args.client_timeout + 2)  # the fault's length
                self.server.signal(signal.SIGCONT)
            self.bump(0)
        elif kind == "engine-kill":
            self.bump(1 + slot)
            before = self.counter(slot, "registrations")
            os.kill(self.engines[slot].pid, signal.SIGKILL)
            self.engines[slot].join()
            self.engines[slot] = self.spawn_engine(slot)
            self.wait_registered(slot, before)
            self.bump(1 + slot)
        else:  # client-stop
            self.bump(1 + slot)
            os.kill(self.engines[slot].pid, signal.SIGSTOP)
            time.sleep(self.args.client_stop_seconds)  # the fault's length
            os.kill(self.engines[slot].pid, signal.SIGCONT)
            self.bump(1 + slot)
        self.faults[kind] += 1
        self.fault_log.append(
            {
                "kind": kind,
                "at_s": round(began - self.t0, 1),
                "took_s": round(time.monotonic() - began, 2),
                "engine": slot if kind in ("engine-kill", "client-stop") else None,
            }
        )

    def switch_phase(self) -> None:
        """Into the burn phase: the same port, a server with a burning thread."""
        self.bump(0)
        self.shared.phase.value = 1
        self.mark_phase()  # the restart is the burn phase's first seconds
        with self._lock:
            self.server.stop()
            self.server.start(burn=True)
        self.bump(0)

    def mark_phase(self) -> None:
        phase = se.PHASES[self.shared.phase.value]
        self.phase_marks.append((phase, time.monotonic(), list(self.shared.counters)))

    def check_processes(self) -> None:
        for slot, proc in enumerate(self.engines):
            if not proc.is_alive():  # crashed by itself: a finding, replace it
                self.unplanned["engine_exits"] += 1
                self.bump(1 + slot)
                self.engines[slot] = self.spawn_engine(slot)
                self.bump(1 + slot)
        if self.server.proc.poll() is not None:
            self.unplanned["server_exits"] += 1
            self.bump(0)
            with self._lock:
                self.server.start(self.server.burn)
            self.bump(0)

    # -- sampling ----------------------------------------------------------------
    def sample_forever(self) -> None:
        tty = sys.stderr.isatty()
        last_scrape = 0.0
        while not self._done.wait(0.5):
            with self._lock:  # not while it restarts
                pid, start = self.server.pid, self.server.starts
                rss = vm_rss(pid)
                if rss is not None:
                    now = time.monotonic() - self.t0
                    self.rss.append((now, self.shared.phase.value, start, rss))
            if time.monotonic() - last_scrape > 2:
                self.server.scrape_evictions(start)
                last_scrape = time.monotonic()
            if tty:
                self.progress()

    def progress(self) -> None:
        tot = self.totals(list(self.shared.counters))
        faults = sum(self.faults.values())
        rss = self.rss[-1][3] >> 20 if self.rss else 0
        phase = se.PHASES[self.shared.phase.value]
        sys.stderr.write(
            f"\r{time.monotonic() - self.t0:6.0f} s  {phase}"
            f"  queries {tot['queries']}  verified {tot['verified_bytes'] / 2**30:.2f}"
            f" GiB  wrong {tot['wrong_blocks']}  lost {tot['lost_blocks']}"
            f"  faults {faults}  rss {rss} MiB "
        )
        sys.stderr.flush()

    def totals(self, counters: list[int]) -> dict[str, int]:
        k = len(se.COUNTERS)
        return {
            name: sum(counters[s * k + i] for s in range(self.n))
            for i, name in enumerate(se.COUNTERS)
        }

    # -- the run ----------------------------------------------------------------------
    def run(self) -> dict[str, object]:
        args = self.args
        self.server.start(burn=args.seconds == args.burn_phase_seconds)
        if self.server.burn:
            self.shared.phase.value = 1
        self.engines = [self.spawn_engine(slot) for slot in range(self.n)]
        for slot in range(self.n):
            self.wait_registered(slot, 0)
        self.t0 = time.monotonic()
        self.mark_phase()
        self.shared.go.value = 1
        sampler = threading.Thread(target=self.sample_forever, daemon=True)
        sampler.start()
        end = self.t0 + args.seconds
        switch_at = end - args.burn_phase_seconds
        next_fault = self.t0 + args.fault_every
        turn = 0
        try:
            while time.monotonic() < end:
                now = time.monotonic()
                if (
                    not self.server.burn
                    and args.burn_phase_seconds
                    and now >= switch_at
                ):
                    self.switch_phase()
                elif args.faults and now >= next_fault:
                    self.inject(args.faults[turn % len(args.faults)])
                    turn += 1
                    next_fault = max(
                        next_fault + args.fault_every, time.monotonic() + 2
                    )
                self.check_processes()
                time.sleep(0.1)
        finally:
            seconds = time.monotonic() - self.t0
            self.shutdown()
            self._done.set()
            sampler.join()
            if sys.stderr.isatty():
                sys.stderr.write("\n")
        return self.report(seconds)

    def shutdown(self) -> None:
        self.shared.stop.value = 1
        deadline = time.monotonic() + 3 * self.args.client_timeout + 10
        for proc in self.engines:
            with contextlib.suppress(OSError):  # never leave one stopped
                os.kill(proc.pid, signal.SIGCONT)
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.server.stop()

    # -- the report --------------------------------------------------------------
    def report(self, seconds: float) -> dict[str, object]:
        final = list(self.shared.counters)
        marks = [*self.phase_marks, ("", self.t0 + seconds, final)]
        phases = {}
        for (name, t_a, c_a), (_, t_b, c_b) in zip(marks, marks[1:], strict=False):
            delta = [b - a for a, b in zip(c_a, c_b, strict=True)]
            phases[name] = {
                "seconds": round(t_b - t_a, 1),
                **self.totals(delta),
                **self.latency(se.PHASES.index(name)),
                **self.rss_of(se.PHASES.index(name)),
            }
        tot = self.totals(final)
        return {
            "config": {k: v for k, v in vars(self.args).items() if k != "json"},
            "seconds": round(seconds, 1),
            "requests": {
                "query": tot["queries"],
                "load": tot["loads"],
                "save": tot["saves"],
                "register": tot["registrations"] + tot["register_failures"],
            },
            "faults": self.faults,
            "fault_log": self.fault_log,
            "unplanned_exits": self.unplanned,
            "verified_bytes": tot["verified_bytes"],
            "verified_blocks": tot["verified_blocks"],
            "wrong_blocks": tot["wrong_blocks"],
            "lost_blocks": tot["lost_blocks"],
            "lost_loads": tot["lost_loads"],
            "expected_failures": tot["expected_failures"],
            "unexpected_failures": {
                k.removeprefix("unexpected_").removesuffix("_failures"): v
                for k, v in tot.items()
                if k.startswith("unexpected_")
            },
            "evictions": int(sum(self.server.evictions)),
            "server_starts": self.server.starts,
            "rss": self.rss_of(None),
            "totals": tot,
            "phases": phases,
        }

    def latency(self, phase: int) -> dict[str, float | int | None]:
        h = (
            np.array(self.shared.hist, np.int64)
            .reshape(self.n, len(se.PHASES), se.BUCKETS)[:, phase]
            .sum(axis=0)
        )
        total = int(h.sum())
        if not total:
            return {"query_samples": 0, "query_p50_ms": None, "query_p99_ms": None}
        cdf = np.cumsum(h)

        def pct(q: float) -> float:
            i = int(np.searchsorted(cdf, q * total))
            return round(se.bucket_seconds(i) * 1e3, 3)

        return {
            "query_samples": total,
            "query_p50_ms": pct(0.5),
            "query_p99_ms": pct(0.99),
        }

    def rss_of(self, phase: int | None) -> dict[str, int | None]:
        rows = [r for r in self.rss if phase is None or r[1] == phase]
        if not rows:
            return {"rss_start": None, "rss_end": None, "rss_max": None}
        return {
            "rss_start": rows[0][3],
            "rss_end": rows[-1][3],
            "rss_max": max(r[3] for r in rows),
        }


def print_report(rep: dict) -> None:
    mib = 1 << 20
    rows = []
    for name, p in rep["phases"].items():
        rows.append(
            {
                "phase": name,
                "s": p["seconds"],
                "queries": p["queries"],
                "loads": p["loads"],
                "saves": p["saves"],
                "regs": p["registrations"],
                "verified_GiB": round(p["verified_bytes"] / 2**30, 2),
                "wrong": p["wrong_blocks"],
                "lost": p["lost_blocks"],
                "expected_fail": p["expected_failures"],
                "q_P50_ms": p["query_p50_ms"],
                "q_P99_ms": p["query_p99_ms"],
                "rss_MiB": "/".join(
                    "-" if p[k] is None else str(p[k] // mib)
                    for k in ("rss_start", "rss_end", "rss_max")
                ),
            }
        )
    print(table(rows, list(rows[0])))
    print()
    rss = rep["rss"]
    summary = [
        {
            **{f"fault:{k}": v for k, v in rep["faults"].items()},
            "evictions": rep["evictions"],
            "wrong": rep["wrong_blocks"],
            "lost": rep["lost_blocks"],
            "unexpected": sum(rep["unexpected_failures"].values()),
            "rss_start/end/max_MiB": "/".join(
                "-" if rss[k] is None else str(rss[k] // mib)
                for k in ("rss_start", "rss_end", "rss_max")
            ),
        }
    ]
    print(table(summary, list(summary[0])))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0, help="whole run")
    p.add_argument(
        "--burn-phase-seconds",
        type=float,
        default=100.0,
        help="the last part of --seconds with a CPU-burning thread in the server "
        "(0: none)",
    )
    p.add_argument("--engines", type=int, default=4)
    p.add_argument(
        "--faults",
        type=lambda s: [k for k in s.split(",") if k],
        default=list(FAULTS),
        help=f"comma-separated, in turn: {','.join(FAULTS)} (default: all; '' none)",
    )
    p.add_argument("--fault-every", type=float, default=15.0, help="seconds")
    p.add_argument("--client-timeout", type=float, default=5.0, help="seconds")
    p.add_argument("--client-stop-seconds", type=float, default=3.0)
    p.add_argument("--pool-size", default="16mb")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--blocks-per-prompt", type=int, default=8)
    p.add_argument("--engine-blocks", type=int, default=64, help="per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="server and engine logs")
    p.add_argument("--json", default=None, help="where to write the JSON report")
    args = p.parse_args(argv)
    bad = [k for k in args.faults if k not in FAULTS]
    if bad:
        p.error(f"--faults: unknown {bad}; choose from {FAULTS}")
    if not 0 <= args.burn_phase_seconds <= args.seconds:
        p.error("--burn-phase-seconds must lie in [0, --seconds]")
    if args.engine_blocks < 2 * args.blocks_per_prompt:
        p.error("--engine-blocks must hold two prompts (save and load halves)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pegaflow-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rep = Soak(args, log_dir).run()
    rep["log_dir"] = str(log_dir)
    print_report(rep)
    out = write_json("soak", rep, args.json)
    print(f"\nwrote {out}; logs in {log_dir}")
    return 1 if rep["wrong_blocks"] or rep["lost_blocks"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
