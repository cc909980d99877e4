"""The copy kernels' launch through cuLaunchKernel (pegaflow.kernels.
driver_launch), without a GPU: numba launches a stream's first call, the
driver every later one with the arguments packed where the parameter array
points; a kernel whose driver function cannot be found stays with numba."""

from __future__ import annotations

import ctypes

import pytest

d = pytest.importorskip("cuda.bindings.driver")

from pegaflow.kernels import driver_launch  # noqa: E402


class FakeKernel:
    """A numba dispatcher's launch syntax: kernel[blocks, threads, stream](*args)."""

    def __init__(self) -> None:
        self.numba_launches: list[tuple] = []

    def __getitem__(self, config):
        return lambda *args: self.numba_launches.append((config, args))


class Stream:
    def __init__(self, handle: int) -> None:
        self.handle = handle


@pytest.fixture
def driver_calls(monkeypatch):
    calls = []

    def launch(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointers = (ctypes.c_void_p * 3).from_address(params)
        values = [ctypes.c_uint64.from_address(p).value for p in pointers]
        calls.append((func, gx, bx, int(stream), values))
        return (d.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(d, "cuLaunchKernel", launch)
    return calls


def test_first_launch_numba_then_the_driver(monkeypatch, driver_calls) -> None:
    kernel, func = FakeKernel(), d.CUfunction()
    monkeypatch.setattr(driver_launch, "_function", lambda k: func)
    launch = driver_launch.DriverLaunch(kernel, 3)
    first = Stream(7)
    launch(4, 256, first, (1, 2**63 + 5, 9))
    assert kernel.numba_launches == [((4, 256, first), (1, 2**63 + 5, 9))]
    assert not driver_calls
    launch(5, 128, first, (10, 20, 30))
    launch(6, 128, first, (11, 21, 31))
    assert driver_calls == [
        (func, 5, 128, 7, [10, 20, 30]),
        (func, 6, 128, 7, [11, 21, 31]),
    ]
    launch(2, 64, Stream(8), (0, 0, 0))  # another stream: numba first again
    assert len(kernel.numba_launches) == 2 and len(driver_calls) == 2
    del first
    again = Stream(7)  # the handle value reused by a new stream: starts over
    launch(3, 64, again, (1, 1, 1))
    assert len(kernel.numba_launches) == 3 and len(driver_calls) == 2


def test_no_driver_function_keeps_numba(monkeypatch, driver_calls) -> None:
    kernel = FakeKernel()
    monkeypatch.setattr(driver_launch, "_function", lambda k: None)
    launch = driver_launch.DriverLaunch(kernel, 3)
    stream = Stream(9)
    for _ in range(3):
        launch(1, 32, stream, (1, 2, 3))
    assert len(kernel.numba_launches) == 3 and not driver_calls


def test_an_unknown_kernel_shape_is_no_function() -> None:
    class NoOverloads:
        overloads: dict = {}

    assert driver_launch._function(NoOverloads()) is None
