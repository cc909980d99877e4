"""The kill-on-load fault (hooks/sitecustomize.py arms it in an engine)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

STOP_TO_KILL_S = 0.5


def _claim(trigger: Path) -> int | None:
    """The pid in the trigger file, taken by one process only (the rename)."""
    fired = trigger.with_suffix(".fired")
    try:
        os.rename(trigger, fired)
    except FileNotFoundError:
        return None
    return int(fired.read_text())


def arm_kill_on_load(trigger: str) -> None:
    from pegaflow.client.pegaflow_client import PegaflowClient

    original = PegaflowClient._load
    path = Path(trigger)

    def load(self: PegaflowClient, *args: Any, **kwargs: Any) -> Any:
        pid = _claim(path)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            threading.Timer(STOP_TO_KILL_S, _kill, (pid,)).start()
        return original(self, *args, **kwargs)

    PegaflowClient._load = load


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
