"""What the GPU end-to-end tests share: engine processes made on demand and
closed after, the server's /health, and a small Llama-like KV shape. The
helpers are imported from here (`from tests.gpu.conftest import health`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator

import pytest

from tests.procs import EngineProc, ServerProc, wait_until

LLAMA = dict(layers=4, blocks=64, heads=8, block_size=16, head=128)  # 16 MiB


@pytest.fixture
def engine() -> Iterator[Callable[..., EngineProc]]:
    """Makes engine processes (EngineProc's keywords); closes each after."""
    made: list[EngineProc] = []

    def make(**kw: object) -> EngineProc:
        made.append(EngineProc(**kw))
        return made[-1]

    yield make
    for proc in made:
        proc.close()


def health(server: ServerProc) -> dict:
    status, body = server.get("/health")
    assert status == 200, body
    return json.loads(body)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    return wait_until(predicate, timeout)


def tokens(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]
