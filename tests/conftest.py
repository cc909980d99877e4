from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.procs import EngineProc, ServerProc, start_server


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProc]]:
    started: list[ServerProc] = []

    def start(*args: str) -> ServerProc:
        srv = start_server(tmp_path, *args)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def server(server_factory: Callable[..., ServerProc]) -> ServerProc:
    return server_factory("--pool-size", "64mb")


@pytest.fixture
def engines() -> Iterator[Callable[[], EngineProc]]:
    made: list[EngineProc] = []

    def make() -> EngineProc:
        proc = EngineProc()
        made.append(proc)
        return proc

    yield make
    for proc in made:
        proc.close()
