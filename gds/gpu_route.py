"""Which route an SSD hit of a CUDA engine takes, chosen once at start:
"direct" (kvikio reads into the engine's GPU blocks, gds.gpu_reads) or "l1"
(SSD → L1 slots → the copy kernels or copy engines).

The server's `--ssd-gpu-direct` (SsdConfig.gpu_direct); pegaflow.tiers.ssd_gpu_direct
takes the direct route where this chooses it. `auto` takes the direct route
only where GPUDirect Storage is present (kvikio not in its POSIX
compatibility mode): there the disk DMAs into GPU memory and the L1 hop is
pure cost. In compatibility mode (no nvidia-fs, as
on the H200 test machine) kvikio itself reads through a host bounce buffer, so
the direct route is SSD → bounce → GPU plus a fetch-back for the checksum,
against SSD → L1 (hashed in place) → GPU: `on` forces it where a measurement
(benchmarks/gds_direct.py) says it wins, `off` never takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import GpuDirect

Route = Literal["direct", "l1"]


@dataclass(frozen=True, slots=True)
class RouteChoice:
    route: Route
    reason: str  # for the startup log and /health


def gds_present() -> bool | None:
    """True: kvikio would use GDS; False: its compatibility mode; None:
    kvikio is not usable here (not installed, no CUDA driver)."""
    from . import kvikio_io

    if kvikio_io.unavailable() is not None:
        return None
    _, defaults, _ = kvikio_io.load_kvikio()
    return not kvikio_io.compat_mode(defaults)


def choose(setting: GpuDirect, present: bool | None) -> RouteChoice:
    """The route for `setting` given gds_present()'s answer."""
    if setting == "off":
        return RouteChoice("l1", "setting off")
    if present is None:
        if setting == "on":
            raise ValueError(
                "gpu_direct: 'on' needs kvikio and a CUDA driver "
                "(pip install 'pegaflow-py[gds]'); use auto or off"
            )
        return RouteChoice("l1", "kvikio not usable here")
    if present:
        return RouteChoice("direct", "GPUDirect Storage present")
    if setting == "on":
        return RouteChoice("direct", "setting on, in kvikio's compatibility mode")
    return RouteChoice(
        "l1",
        "no GPUDirect Storage (kvikio compatibility mode); the setting on "
        "forces the direct route",
    )
