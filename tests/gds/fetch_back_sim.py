"""DeviceFetch (pegaflow.copiers.fetch_back) on numba's CUDA simulator; run by
test_gpu_reads.py in a fresh process (the simulator must be on before numba.cuda
is imported). Prints "ok"."""

from __future__ import annotations

import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
import numpy as np  # noqa: E402

from pegaflow.copiers.fetch_back import DeviceFetch  # noqa: E402

dev = np.random.default_rng(0).integers(0, 256, 4096, np.uint8)
base = dev.ctypes.data
f = DeviceFetch(capacity=256)
src = np.array([base + 1024, base + 64, base + 2048], np.uint64)
n = np.array([64, 128, 32], np.uint64)
view = f(src, n, 224)
want = np.concatenate([dev[1024:1088], dev[64:192], dev[2048:2080]])
assert bytes(view) == want.tobytes(), "mismatch"
view = f(src[:1], n[:1] * 8, 512)  # grows
assert bytes(view) == dev[1024:1536].tobytes()
print("ok")
