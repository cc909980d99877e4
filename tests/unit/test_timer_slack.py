"""Every thread of the real server runs with the short timer slack
(pegaflow.timer_slack): its GPU polls sleep(0) between reads, and at the
kernel's default slack each of those slept 50 us."""

from __future__ import annotations

import os
import threading

from pegaflow import timer_slack
from tests.procs import start_server


def slack_ns(tid: int) -> int:
    with open(f"/proc/{tid}/timerslack_ns") as f:
        return int(f.read())


def test_every_server_thread_has_the_short_slack(tmp_path):
    # One BLAS thread starts when numpy is imported, before main() runs;
    # it does no server work, and with one BLAS thread there is none.
    server = start_server(
        tmp_path, "--pool-size", "64mb", env={"OPENBLAS_NUM_THREADS": "1"}
    )
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{server.pid}/task")]
        assert len(tids) > 3  # grpc's and the loop's threads are up
        slacks = {tid: slack_ns(tid) for tid in tids}
        assert all(s <= timer_slack.SERVER_SLACK_NS for s in slacks.values()), slacks
    finally:
        server.stop()


def test_threads_started_after_tighten_inherit_it():
    seen: list[int] = []

    def child() -> None:
        seen.append(slack_ns(threading.get_native_id()))

    def run() -> None:
        assert timer_slack.tighten(2_000)
        worker = threading.Thread(target=child)
        worker.start()
        worker.join()

    # In a thread of its own, so the test process's slack stays as it was.
    mine = slack_ns(threading.get_native_id())
    outer = threading.Thread(target=run)
    outer.start()
    outer.join()
    assert seen == [2_000]
    assert slack_ns(threading.get_native_id()) == mine
