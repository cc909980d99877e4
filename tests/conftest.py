from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.procs import EngineProc, ServerProc, start_server


@pytest.fixture(scope="session")
def gpu() -> None:
    """For the `gpu`-marked server tests: a real CUDA GPU, not the simulator."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the CUDA simulator is on")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


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
