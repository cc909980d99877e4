"""A process that stands for the host engine in tests that drive the server's
Engine inside the test process. The server opens a registered process's
/proc/<pid>/mem and refuses its own pid, so the engine must be another
process the test may read: a child of ours, asleep until the tests end."""

from __future__ import annotations

import atexit
import subprocess

_sleeper = subprocess.Popen(["sleep", "86400"])
atexit.register(_sleeper.kill)

ENGINE_PID = _sleeper.pid
