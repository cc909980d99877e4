"""Whether work lets other threads run: the GIL probe of the tests that
check a hash or copy drops it."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def turns_while(work: Callable[[], None]) -> int:
    """Run `work` in a thread and count this thread's turns at the GIL until
    it is done. The switch interval is raised past the test, so work that
    holds the GIL throughout leaves this thread no turn at all (0 or 1);
    work that drops it while it runs leaves many."""
    done, started = threading.Event(), threading.Event()

    def run() -> None:
        started.set()
        try:
            work()
        finally:
            done.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        worker = threading.Thread(target=run)
        worker.start()
        started.wait()
        turns = 0
        while not done.is_set():
            turns += 1
            time.sleep(0)  # gives the GIL back each turn
        worker.join()
    finally:
        sys.setswitchinterval(before)
    return turns
