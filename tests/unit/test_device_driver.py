"""The copy kernel's launch through cuLaunchKernel (pegaflow.kernels.
device_driver), without a GPU: the driver's calls are stand-ins that record
what a launch hands them.

The parameters are read by the driver during cuLaunchKernel, which
cuda-python calls without the GIL; with one buffer for every stream (the
code before), a launch on another stream in that window refilled it and the
first kernel ran with the second's arguments: a save and a load at once on
one GPU could copy the wrong pages."""

from __future__ import annotations

import ctypes

import pytest

d = pytest.importorskip("cuda.bindings.driver")

from pegaflow.kernels import device_driver  # noqa: E402


def _params(params: int) -> list[int]:
    pointers = (ctypes.c_void_p * device_driver.PARAMS).from_address(params)
    return [ctypes.c_uint64.from_address(p).value for p in pointers]


@pytest.fixture
def streams(monkeypatch):
    """Streams whose creation and kernel need no GPU."""
    handles = iter(range(100, 200))
    monkeypatch.setattr(device_driver, "kernel_function", lambda: "kernel")
    monkeypatch.setattr(
        device_driver.dr, "cuStreamCreate",
        lambda flags: (d.CUresult.CUDA_SUCCESS, d.CUstream(next(handles))),
    )  # fmt: skip
    monkeypatch.setattr(device_driver.dr, "cuStreamDestroy", lambda s: None)
    return device_driver.Stream


def test_a_launch_hands_the_driver_its_own_arguments(monkeypatch, streams) -> None:
    calls = []

    def launch(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        calls.append((func, gx, bx, int(stream), _params(params)))
        return (d.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(device_driver.dr, "cuLaunchKernel", launch)
    s = streams()
    args = (1, 2**63 + 5, 3, 4, 5, 6, 1024, 16)
    s.launch(4, 256, args)
    s.launch(5, 128, tuple(range(8)))
    assert calls == [
        ("kernel", 4, 256, s.handle, list(args)),
        ("kernel", 5, 128, s.handle, list(range(8))),
    ]


def test_a_launch_on_another_stream_meanwhile_leaves_the_first_intact(
    monkeypatch, streams
) -> None:
    save, load = streams(), streams()
    seen = {}

    def launch(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        if int(stream) == save.handle and not seen:
            seen["load"] = None
            load.launch(1, 32, (9,) * 8)  # another thread, while the GIL is free
        seen[int(stream)] = _params(params)
        return (d.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(device_driver.dr, "cuLaunchKernel", launch)
    save.launch(1, 32, tuple(range(1, 9)))
    assert seen[save.handle] == list(range(1, 9))
    assert seen[load.handle] == [9] * 8


def test_a_failed_launch_names_the_cuda_error(monkeypatch, streams) -> None:
    monkeypatch.setattr(
        device_driver.dr, "cuLaunchKernel",
        lambda *a: (d.CUresult.CUDA_ERROR_INVALID_VALUE,),
    )  # fmt: skip
    with pytest.raises(device_driver.CudaError, match="kernel launch: .*INVALID_VALUE"):
        streams().launch(1, 32, (0,) * 8)


@pytest.fixture
def no_gpu_context(monkeypatch):
    """kernel_function's context and architecture calls, without a GPU."""
    monkeypatch.setattr(device_driver, "_functions", {})
    monkeypatch.setattr(device_driver.rt, "cudaFree", lambda p: (0,))
    monkeypatch.setattr(
        device_driver.dr, "cuCtxGetCurrent",
        lambda: (d.CUresult.CUDA_SUCCESS, d.CUcontext(77)),
    )  # fmt: skip
    monkeypatch.setattr(device_driver, "_arch", lambda: "sm_90")


def test_a_cached_image_the_driver_refuses_is_compiled_again(
    monkeypatch, no_gpu_context
) -> None:
    asked = []

    def load_or_compile(arch, compile_image, fresh=False):
        asked.append(fresh)
        return (b"fresh" if fresh else b"stale", "entry")

    def load(image):
        if image == b"stale":
            return (d.CUresult.CUDA_ERROR_INVALID_IMAGE, None)
        return (d.CUresult.CUDA_SUCCESS, d.CUmodule(5))

    monkeypatch.setattr(device_driver.cubin_cache, "load_or_compile", load_or_compile)
    monkeypatch.setattr(device_driver.dr, "cuModuleLoadData", load)
    monkeypatch.setattr(
        device_driver.dr, "cuModuleGetFunction",
        lambda module, name: (d.CUresult.CUDA_SUCCESS, d.CUfunction(9)),
    )  # fmt: skip
    first = device_driver.kernel_function()
    assert asked == [False, True] and int(first) == 9
    assert device_driver.kernel_function() is first  # once per context
    assert asked == [False, True]


def test_importing_the_cuda_backend_imports_no_numba_cuda() -> None:
    """A warm restart's GPU half must not pay numba-cuda's import (~1.5 s on
    the H100 host): only a compile of the kernel brings it in."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from pegaflow import kernels; k = kernels.backend('cuda'); "
        "assert not k.SIMULATED; kernels.table_jit.compiled(); "
        "print(sorted(m for m in sys.modules if m.startswith('numba.cuda')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env,
        timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
