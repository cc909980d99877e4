"""A copy that fails after part of it was queued (the second of two DMA
batches refused, the event record after a launch) returns only once the
stream has drained: the engine frees or unpins the slots it writes as soon
as the copier returns (run here with stand-ins for the driver and kernels)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pegaflow import cuda_driver
from pegaflow.copiers import cuda as cuda_copier
from pegaflow.copiers.cuda import CudaCopyEngine
from pegaflow.geometry import Transfers

T = Transfers(*(np.array([0], np.uint64),) * 2, np.array([64], np.uint64))


class Kernels:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def gather(self, *a: Any, **kw: Any) -> None:
        self.log.append("queued")
        raise cuda_driver.CudaError("cuEventRecord: CUDA_ERROR_LAUNCH_FAILED")

    scatter = gather

    def synchronize(self, stream: Any) -> None:
        self.log.append(f"sync {stream}")


class Stream(SimpleNamespace):
    def __str__(self) -> str:
        return self.name


class Policy:
    def __init__(self, path: str) -> None:
        self.path = path

    def choose_for(self, direction: str, t: Transfers, device: int) -> str:
        return self.path


def _engine(path: str, log: list[str]) -> CudaCopyEngine:
    engine = object.__new__(CudaCopyEngine)  # no GPU behind it
    engine._k, engine._policy, engine._ctas, engine._attrs = (
        Kernels(log),
        Policy(path),
        1,
        {},
    )

    def dma(plan: Any, attrs: Any, stream: int) -> None:
        log.append("queued")
        raise cuda_driver.CudaError("cuMemcpyBatchAsync: the second call refused")

    engine._dma = dma
    return engine


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("direction", ["save", "load"])
def test_a_copy_failing_after_queueing_waits_for_the_stream(
    monkeypatch, path: str, direction: str
) -> None:
    monkeypatch.setattr(cuda_driver, "set_device", lambda ordinal: None)
    monkeypatch.setattr(cuda_copier.dma, "plan", lambda *args: None)
    monkeypatch.setattr(cuda_copier.dma, "attributes", lambda d, o: None)
    log: list[str] = []
    engine = _engine(path, log)
    save, load = Stream(name="S", handle=1), Stream(name="L", handle=2)
    pool = SimpleNamespace(address=1 << 30)
    dev = SimpleNamespace(ordinal=0, save=save, load=load, pool=pool, flags={})
    regions = SimpleNamespace(device=dev, buffer=None)
    with pytest.raises(cuda_driver.CudaError):
        if direction == "save":
            engine.gather(regions, T)
        else:
            engine.scatter(regions, T)
    assert log == ["queued", f"sync {'S' if direction == 'save' else 'L'}"]
