"""pegaflow.server.in_flight: a load's copy started as a task, run up to its
launch at once where asyncio starts tasks eagerly (Python 3.12), and the
copies of loads already answered, whose failure hangs up on their engine."""

from __future__ import annotations

import asyncio

import pytest

from pegaflow.server import in_flight


async def copy(launched: asyncio.Future, ends: asyncio.Future) -> None:
    launched.set_result(True)  # the launch, before the copy's first wait
    await ends


def test_a_copy_is_launched_by_the_time_start_copy_returns_where_eager() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        launched, ends = loop.create_future(), loop.create_future()
        task = in_flight.start_copy(copy(launched, ends))
        assert launched.done() == in_flight.EAGER
        await asyncio.sleep(0)
        assert launched.done() and not task.done()
        ends.set_result(None)
        await task

    asyncio.run(scenario())


@pytest.mark.parametrize("ending", ["lands", "fails", "cancelled"])
def test_only_a_failed_copy_hangs_up_on_its_engine(ending: str) -> None:
    hung_up: list[bool] = []
    loads = in_flight.InFlightLoads()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        launched, ends = loop.create_future(), loop.create_future()
        task = in_flight.start_copy(copy(launched, ends))
        loads.keep(task, lambda: hung_up.append(True))
        assert len(loads) == 1
        if ending == "lands":
            ends.set_result(None)
        elif ending == "fails":
            ends.set_exception(RuntimeError("an illegal address, stand-in"))
        else:
            task.cancel()
        while len(loads):
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert hung_up == ([True] if ending == "fails" else [])


def test_a_stopping_server_waits_for_the_copies_it_answered_then_gives_up() -> None:
    """The pool and the engines' mappings must outlive a copy still running:
    drain waits for it, at most its timeout (a wedged GPU must not hold the
    stop for ever)."""
    loads = in_flight.InFlightLoads()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        launched, ends = loop.create_future(), loop.create_future()
        loads.keep(in_flight.start_copy(copy(launched, ends)), None)
        loop.call_later(0.05, ends.set_result, None)
        start = loop.time()
        await loads.drain(5.0)
        assert 0.04 <= loop.time() - start < 4.0 and not len(loads)
        stuck, never = loop.create_future(), loop.create_future()
        loads.keep(in_flight.start_copy(copy(stuck, never)), None)
        start = loop.time()
        await loads.drain(0.05)
        assert loop.time() - start < 4.0 and len(loads) == 1
        never.cancel()
        await asyncio.sleep(0)

    asyncio.run(scenario())
