"""Fixtures of the connector tests. Tests that drive vLLM's real Scheduler call
`needs_vllm()` first: they skip, saying why, only where vllm is not installed
(scripts/test.sh installs it through scripts/setup.sh --with-vllm)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.procs import ServerProc


def needs_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(
            "vllm is not installed: run scripts/setup.sh --with-vllm "
            "(scripts/test.sh does) to test the connector against its scheduler",
            allow_module_level=True,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def close_engines(server_factory: Callable[..., ServerProc]) -> Iterator[None]:
    """Close the Engines a test left open (tests.connector.engine.OPEN_ENGINES),
    while its servers still run (server_factory stops them after this)."""
    yield
    if "tests.connector.engine" not in sys.modules:  # vllm missing
        return
    from tests.connector.engine import OPEN_ENGINES

    engines = OPEN_ENGINES[:]
    OPEN_ENGINES.clear()
    for engine in engines:
        engine.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs_vllm()
    from tests.connector.engine import model_dir

    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def pega_server(
    server_factory: Callable[..., ServerProc], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., ServerProc]]:
    """Start a server on a fixed port the connector finds through
    PEGAFLOW_HOST / PEGAFLOW_PORT; call again to restart it on that port."""
    port = free_port()
    monkeypatch.setenv("PEGAFLOW_HOST", "http://127.0.0.1")
    monkeypatch.setenv("PEGAFLOW_PORT", str(port))

    def start(*args: str) -> ServerProc:
        return server_factory(
            "--pool-size", "64mb", *args, "--addr", f"127.0.0.1:{port}"
        )

    yield start
