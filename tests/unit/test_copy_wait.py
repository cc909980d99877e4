"""Waiting for a launched GPU batch on the event loop (pegaflow.copiers.copy_wait), and
the engine's choice between that and a copy thread. The GPU is a clock here:
a batch is done once time.perf_counter() passes its end."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pegaflow.common.errors import CopyFailed
from pegaflow.common.geometry import Transfers
from pegaflow.common.settings import EngineConfig
from pegaflow.copiers import copy_wait
from pegaflow.server.engine import Engine
from tests.unit.host_engine import host_engine, save_two_blocks


class Batch:
    def __init__(self, ends_at: float, expected_end: float | None) -> None:
        self.ends_at = ends_at
        self.expected_end = expected_end


class ClockCopier:
    """A copier whose batches finish at a wall-clock time; logs what ran."""

    def __init__(
        self, duration_s: float = 3e-3, expect_s: float | None = 3e-3,
        refuse: bool = False, fail_poll: bool = False,
    ) -> None:  # fmt: skip
        self.duration_s, self.expect_s = duration_s, expect_s
        self.refuse, self.fail_poll = refuse, fail_poll
        self.stream_busy = False
        self.polls = 0
        self.log: list[tuple[str, str]] = []  # (what, thread name)
        self.finished: list[bool] = []  # failed flags

    def _note(self, what: str) -> None:
        self.log.append((what, threading.current_thread().name))

    # -- the engine's CopyEngine seam
    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def event_done(self, handle: object, wait_event: int) -> bool:
        return False

    def gather(self, handle: object, t: Transfers, wait_event: int = 0,
               deadline: float | None = None) -> None:  # fmt: skip
        self._note(f"gather wait_event={wait_event}")

    def scatter(
        self, handle: object, t: Transfers, deadline: float | None = None
    ) -> None:
        self._note("scatter")

    def close(self, handle: object) -> None:
        pass

    def busy(self, handle: object, direction: str) -> bool:
        return self.stream_busy

    # -- launching
    def launch(self, direction: str, handle: object, t: Transfers,
               deadline: float | None) -> Batch | None:  # fmt: skip
        self._note(f"launch {direction}")
        if self.refuse:
            return None
        now = time.perf_counter()
        expected = None if self.expect_s is None else now + self.expect_s
        return Batch(now + self.duration_s, expected)

    def launched_done(self, launched: Batch) -> bool:
        self.polls += 1
        if self.fail_poll:
            raise CopyFailed("stream: an illegal address")
        return time.perf_counter() >= launched.ends_at

    def wait_launched(self, launched: Batch) -> None:
        self._note("wait")
        time.sleep(max(0.0, launched.ends_at - time.perf_counter()))

    def finish_launched(self, launched: Batch, failed: bool = False) -> None:
        self.finished.append(failed)


def _settle(copier: ClockCopier) -> tuple[float, Batch, bool]:
    async def run() -> tuple[float, Batch, bool]:
        batch = copier.launch("load", None, None, None)  # type: ignore[arg-type]
        assert batch is not None
        on_loop = await copy_wait.settle(copier, batch)
        return time.perf_counter(), batch, on_loop

    return asyncio.run(run())


def _waits(engine: Engine) -> dict[str, float | None]:
    get = engine.metrics.registry.get_sample_value
    return {
        w: get("pegaflow_copy_waits_total", {"way": w})
        for w in ("loop", "late", "thread")
    }


def test_a_batch_on_time_is_waited_for_on_the_loop() -> None:
    copier = ClockCopier(duration_s=3e-3, expect_s=3e-3)
    done_at, batch, on_loop = _settle(copier)
    assert done_at >= batch.ends_at and on_loop
    assert [w for w, _ in copier.log] == ["launch load"]  # no thread's wait
    assert copier.finished == [False]
    # The timer covered the whole milliseconds: a few polls, not thousands.
    assert 1 <= copier.polls < 2000


def test_the_loop_serves_others_while_a_batch_runs() -> None:
    copier = ClockCopier(duration_s=6e-3, expect_s=6e-3)
    ticks = 0

    async def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def run() -> None:
        task = asyncio.ensure_future(other())
        batch = copier.launch("save", None, None, None)  # type: ignore[arg-type]
        assert batch is not None
        await copy_wait.settle(copier, batch)
        task.cancel()

    asyncio.run(run())
    assert ticks >= copier.polls > 0  # every poll let the other task run


def test_the_timer_sleeps_whole_ms_and_wakes_early_by_a_share_of_the_wait() -> None:
    assert copy_wait.timer_s(100e-6) == 0  # shorter than the margin: poll at once
    assert copy_wait.timer_s(2.7e-3) == pytest.approx(2e-3)
    assert copy_wait.timer_s(1.1e-3) == 0  # 1.1 - 0.15 ms rounds down to none
    # 27 ms: 3 % early (0.81 ms) leaves 26 whole ms for the timer.
    assert copy_wait.timer_s(27e-3) == pytest.approx(26e-3)
    assert copy_wait.timer_s(100e-3) == pytest.approx(97e-3)


def test_no_estimate_waits_on_a_thread() -> None:
    copier = ClockCopier(duration_s=1e-3, expect_s=None)
    assert _settle(copier)[2] is False
    (_, launched_on), (what, waited_on) = copier.log
    assert what == "wait" and waited_on != launched_on
    assert copier.polls == 0 and copier.finished == [False]


def test_a_late_batch_goes_to_a_thread_after_the_polling_bound() -> None:
    copier = ClockCopier(duration_s=30e-3, expect_s=1e-3)  # 29 ms late
    done_at, batch, on_loop = _settle(copier)
    assert done_at >= batch.ends_at and not on_loop
    (_, launched_on), (what, waited_on) = copier.log
    assert what == "wait" and waited_on != launched_on
    assert copier.finished == [False]


def test_a_fault_seen_while_polling_finishes_the_batch_as_failed() -> None:
    copier = ClockCopier(duration_s=1e-3, expect_s=1e-3, fail_poll=True)
    with pytest.raises(CopyFailed, match="illegal address"):
        _settle(copier)
    assert copier.finished == [True]


# -- the engine's choice --------------------------------------------------------
class ThreadCopier(ClockCopier):
    """A copier that cannot launch (as the host copier): copy threads only."""

    launch = None  # type: ignore[assignment]


def _engine(copier: ClockCopier) -> Engine:
    return host_engine(copier, EngineConfig(inline_copy_bytes=0))


def _save(engine: Engine, wait_event: int = 0) -> object:
    return save_two_blocks(engine, wait_event)


def test_the_engine_launches_a_save_on_the_loop() -> None:
    copier = ClockCopier(duration_s=1e-3, expect_s=1e-3)
    engine = _engine(copier)
    assert _save(engine).stored == 2  # type: ignore[attr-defined]
    assert copier.log == [("launch save", "MainThread")]
    assert copier.finished == [False]
    assert _waits(engine) == {"loop": 1, "late": 0, "thread": 0}


def test_a_copier_without_launch_keeps_the_copy_thread() -> None:
    copier = ThreadCopier()
    engine = _engine(copier)
    assert _save(engine).stored == 2  # type: ignore[attr-defined]
    assert _waits(engine) == {"loop": 0, "late": 0, "thread": 1}
    [(what, thread)] = copier.log
    assert what == "gather wait_event=0" and thread != "MainThread"


def test_a_late_launched_save_is_counted_late() -> None:
    copier = ClockCopier(duration_s=1e-3, expect_s=None)
    engine = _engine(copier)
    assert _save(engine).stored == 2  # type: ignore[attr-defined]
    assert _waits(engine) == {"loop": 0, "late": 1, "thread": 0}


def test_a_refused_launch_falls_back_to_a_copy_thread() -> None:
    copier = ClockCopier(refuse=True)
    assert _save(_engine(copier)).stored == 2  # type: ignore[attr-defined]
    (launch, _), (what, thread) = copier.log
    assert launch == "launch save" and what == "gather wait_event=0"
    assert thread != "MainThread" and copier.finished == []


def test_a_save_waiting_for_an_engine_event_never_launches_on_the_loop() -> None:
    copier = ClockCopier()  # its event_done says: still pending
    engine = _engine(copier)
    assert _save(engine, wait_event=1).stored == 2  # type: ignore[attr-defined]
    [(what, thread)] = copier.log
    assert what == "gather wait_event=1" and thread != "MainThread"


@pytest.mark.parametrize("busy", [False, True])
def test_a_small_copy_leaves_the_loop_when_its_stream_is_busy(busy: bool) -> None:
    """A one-block copy runs on the loop; behind a large copy on its stream
    its sync would hold the loop for the large one too: a thread waits."""
    copier = ClockCopier(refuse=busy)  # a busy stream refuses launches too
    copier.stream_busy = busy
    engine = host_engine(copier)  # inline_copy_bytes 2 MiB: these are small
    assert _save(engine).stored == 2  # type: ignore[attr-defined]
    if busy:
        (launch, _), (what, thread) = copier.log
        assert launch == "launch save" and what == "gather wait_event=0"
        assert thread != "MainThread"
    else:
        assert copier.log == [("gather wait_event=0", "MainThread")]
