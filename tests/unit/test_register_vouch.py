"""A registration over the unix socket names its caller by the pid the kernel
gave at connect(). The server asks whether that process still exists
(SO_PEERPIDFD) before a registration and again once the registration holds
the pid's process: a CUDA registration first waits for the GPU half of the
start (seconds), and a caller that exits meanwhile must not leave a
registration of whichever process took its pid since."""

from __future__ import annotations

import asyncio

import pytest

from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common.errors import PermissionDenied
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.common.identity import Caller
from tests.unit.host_engine import PAGE, host_engine
from tests.unit.stand_in_engine import ENGINE_PID
from tests.unit.test_copy_wait import ClockCopier

LAYER = LayerLayout(0, 0, 8, PAGE, (Segment(0, PAGE),))
SPEC = RegisterSpec(
    "i", "ns", 0, 1, 1, "cpu", "host", ENGINE_PID, ((PAGE, 8 * PAGE),), (LAYER,)
)


def test_a_caller_gone_once_registered_leaves_no_registration() -> None:
    engine = host_engine(ClockCopier())
    asked: list[int] = []

    def vouch() -> None:  # the caller exits while the registration runs
        asked.append(len(engine.registry.instances))
        if len(asked) == 2:
            raise PermissionDenied("register: the process ... has exited")

    caller = Caller("unix", ENGINE_PID, 0)
    with pytest.raises(PermissionDenied):
        asyncio.run(engine.register_when_ready(SPEC, caller, vouch))
    assert asked == [0, 1]  # before, and once the registration held its pid
    assert "i" not in engine.registry.instances


def test_a_caller_still_there_is_registered() -> None:
    engine = host_engine(ClockCopier())
    caller = Caller("unix", ENGINE_PID, 0)
    worker = asyncio.run(engine.register_when_ready(SPEC, caller, lambda: None))
    assert engine.registry.instances["i"] is not None and worker.closed is False
