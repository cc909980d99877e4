"""Test-only fault for a real engine: imported by every Python process of an
engine started with a kill trigger (tests/real_engine/engine.py puts this
folder on its PYTHONPATH), so it reaches vLLM's worker processes, which are
spawned, not forked.

Once the trigger file holds a server pid, the next Load any of the engine's
processes sends stops that server (SIGSTOP), so the call is surely in flight,
and SIGKILLs it half a second later: the server dies mid-load, every time.
"""

from __future__ import annotations

import os

if os.environ.get("PEGAFLOW_TEST_KILL_ON_LOAD"):
    from tests.real_engine.fault import arm_kill_on_load

    arm_kill_on_load(os.environ["PEGAFLOW_TEST_KILL_ON_LOAD"])
