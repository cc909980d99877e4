"""`python -m pegaflow.demo --addr H:P` against a server whose pool is smaller
than the demo's prompt: one line naming the cause and the fix, not the engine
subprocess's traceback (issue 30: a 20-line traceback, "block_ids: 625 blocks
exceed 496 per request")."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import ROOT, _env, start_server


def test_a_pool_too_small_for_the_prompt_is_one_line(tmp_path) -> None:
    server = start_server(tmp_path, "--pool-size", "256mb")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pegaflow.demo", "--addr", server.addr],
            capture_output=True,
            text=True,
            timeout=120,
            env=_env(),
            cwd=ROOT,
        )
    finally:
        server.stop()
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out, out
    last = done.stderr.strip().splitlines()[-1]
    assert "block_ids" in last and "--tokens" in last and "--pool-size" in last, out
