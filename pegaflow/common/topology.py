"""Which NUMA node each served GPU sits on, and where the pool's pages are.

On a multi-socket host every GPU reads the one pool over its own PCIe link;
pages on the other socket's memory cross the socket link on every copy. The
server logs this once at start-up and /stats reports it, so an operator sees
whether to start it under `numactl --interleave` or `--membind`
(docs/operations.md, "Multi-GPU hosts and NUMA").

GPU -> node: the PCI bus id from the CUDA device attributes, then
/sys/bus/pci/devices/<bus id>/numa_node. Pool -> nodes: move_pages(2) with
nodes=NULL over evenly spaced sample pages, one syscall for all of them; the
process's memory policy from get_mempolicy(2). Both through libc's syscall():
glibc exports neither (libnuma does, and is not a dependency).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cuda_driver import CudaError, check

logger = logging.getLogger(__name__)

SYSFS = Path("/sys")
POOL_SAMPLES = 512  # pages sampled per report: one syscall, a few microseconds
# Syscall numbers (asm/unistd.h): glibc wraps neither call.
_SYSCALLS = {
    "x86_64": {"move_pages": 279, "get_mempolicy": 239},
    "aarch64": {"move_pages": 239, "get_mempolicy": 236},
    "ppc64le": {"move_pages": 301, "get_mempolicy": 260},
}
_POLICIES = {
    0: "default",
    1: "preferred",
    2: "bind",
    3: "interleave",
    4: "local",
    5: "preferred_many",
    6: "weighted_interleave",
}
_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)  # MPOL_F_STATIC/RELATIVE/NUMA_BALANCING
_MAX_NODES = 1024  # bits in the nodemask get_mempolicy fills


@dataclass(frozen=True, slots=True)
class GpuPlace:
    ordinal: int
    bus_id: str  # "0000:18:00.0", as sysfs names the device
    numa_node: int | None  # None: the kernel knows none (-1) or no sysfs entry


@dataclass(frozen=True, slots=True)
class PoolPlace:
    sampled: int  # pages asked about
    by_node: tuple[tuple[int, int], ...]  # (node, sampled pages there), by node
    not_present: int  # not faulted in yet (an unpinned pool before pre-touch)
    policy: str  # the process's memory policy: "default", "interleave 0-1", ...


# -- GPUs ---------------------------------------------------------------------
def cuda_bus_id(ordinal: int) -> str:
    """The device's PCI address from its CUDA attributes (no nvidia-smi)."""
    from cuda.bindings import driver

    check(driver.cuInit(0), "cuInit")
    dev = check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    attr = driver.CUdevice_attribute
    parts = [
        check(driver.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a.name})")
        for a in (
            attr.CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
            attr.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
            attr.CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
        )
    ]
    return bus_id(*(int(p) for p in parts))


def bus_id(domain: int, bus: int, device: int, function: int = 0) -> str:
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def numa_node_of(bus: str, sysfs: Path = SYSFS) -> int | None:
    """The node sysfs gives the PCI device; None for -1 (no affinity, as on
    one-node hosts and most VMs) or a device sysfs does not list."""
    try:
        node = int((sysfs / "bus/pci/devices" / bus.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_places(
    ordinals: Sequence[int],
    bus_of: Callable[[int], str] = cuda_bus_id,
    sysfs: Path = SYSFS,
) -> tuple[GpuPlace, ...]:
    places = []
    for ordinal in ordinals:  # a few GPUs, once
        bus = bus_of(ordinal)
        places.append(GpuPlace(ordinal, bus, numa_node_of(bus, sysfs)))
    return tuple(places)


def online_nodes(sysfs: Path = SYSFS) -> list[int]:
    """/sys/devices/system/node/online ("0", "0-1", "0,2-3"); [0] without it."""
    try:
        text = (sysfs / "devices/system/node/online").read_text().strip()
    except OSError:
        return [0]
    return parse_node_list(text)


def parse_node_list(text: str) -> list[int]:
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes


# -- the pool's pages -----------------------------------------------------------
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _number(name: str) -> int:
    table = _SYSCALLS.get(platform.machine())
    if table is None:
        raise OSError(errno.ENOSYS, f"{name}: unknown on {platform.machine()}")
    return table[name]


def page_nodes(addresses: np.ndarray) -> np.ndarray:
    """move_pages(2) with nodes=NULL: the node of each page holding an address
    (int32), or -errno (-ENOENT: not faulted in yet). One syscall for all."""
    pages = np.ascontiguousarray(addresses, np.uint64)
    status = np.full(len(pages), -errno.ENOENT, np.int32)
    if not len(pages):
        return status
    got = _libc().syscall(
        ctypes.c_long(_number("move_pages")),
        ctypes.c_long(0),  # this process
        ctypes.c_ulong(len(pages)),
        ctypes.c_void_p(pages.ctypes.data),
        ctypes.c_void_p(None),  # nodes=NULL: ask, move nothing
        ctypes.c_void_p(status.ctypes.data),
        ctypes.c_int(0),
    )
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"move_pages: {os.strerror(err)}")
    return status


def memory_policy() -> str:
    """The calling thread's policy (numactl sets the process's, which every
    thread inherits): "default", "interleave 0-1", "bind 1", ..."""
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * (_MAX_NODES // 64))()
    got = _libc().syscall(
        ctypes.c_long(_number("get_mempolicy")),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(_MAX_NODES),
        ctypes.c_void_p(None),
        ctypes.c_ulong(0),
    )
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy: {os.strerror(err)}")
    name = _POLICIES.get(mode.value & ~_MODE_FLAGS, f"mode {mode.value}")
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")
    nodes = np.flatnonzero(bits).tolist()
    return name if name in ("default", "local") else f"{name} {_ranges(nodes)}"


def _ranges(nodes: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5", as numactl writes node lists."""
    out, i = [], 0
    while i < len(nodes):
        j = i
        while j + 1 < len(nodes) and nodes[j + 1] == nodes[j] + 1:
            j += 1
        out.append(str(nodes[i]) if i == j else f"{nodes[i]}-{nodes[j]}")
        i = j + 1
    return ",".join(out)


def pool_place(base: int, size: int, samples: int = POOL_SAMPLES) -> PoolPlace:
    """Where `samples` evenly spaced pages of [base, base + size) are."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, pages = base // page, max(1, -(-(base + size) // page) - base // page)
    idx = np.unique(np.linspace(0, pages - 1, min(samples, pages)).astype(np.uint64))
    status = page_nodes((np.uint64(first) + idx) * np.uint64(page))
    nodes, counts = np.unique(status[status >= 0], return_counts=True)
    by_node = tuple(zip(nodes.tolist(), counts.tolist(), strict=True))
    missing = int((status == -errno.ENOENT).sum())
    return PoolPlace(len(status), by_node, missing, memory_policy())


# -- what the server tells ------------------------------------------------------
class Placement:
    """The served GPUs' nodes (read once: they never move) and the pool's
    pages (sampled at each report: pre-touch and the kernel move them)."""

    def __init__(
        self,
        ordinals: Sequence[int],
        pool_base: int,
        pool_size: int,
        bus_of: Callable[[int], str] = cuda_bus_id,
        sysfs: Path = SYSFS,
    ) -> None:
        self._ordinals = list(ordinals)
        self._base, self._size = pool_base, pool_size
        self._bus_of, self._sysfs = bus_of, sysfs
        self._gpus: tuple[GpuPlace, ...] | None = None

    def gpus(self) -> tuple[GpuPlace, ...]:
        if self._gpus is None:  # two threads may both read it: the same answer
            self._gpus = gpu_places(self._ordinals, self._bus_of, self._sysfs)
        return self._gpus

    def report(self) -> dict[str, object]:
        """/stats' "topology": a failure to read one half is named, not raised
        (a report must never fail the document it is part of)."""
        out: dict[str, object] = {"nodes": online_nodes(self._sysfs)}
        try:
            out["gpus"] = [
                {"device": g.ordinal, "bus_id": g.bus_id, "numa_node": g.numa_node}
                for g in self.gpus()
            ]
        except (ImportError, OSError, CudaError) as exc:
            out["gpus"] = f"unknown: {exc}"
        try:
            pool = pool_place(self._base, self._size)
            out["pool"] = {
                "sampled_pages": pool.sampled,
                "pages_by_node": {str(n): c for n, c in pool.by_node},
                "not_present": pool.not_present,
                "policy": pool.policy,
            }
        except OSError as exc:
            out["pool"] = f"unknown: {exc}"
        return out

    def log(self) -> dict[str, object]:
        """Once at start-up, after the pool is pinned (its pages then exist);
        a warning when a GPU reads a pool with no pages on its own node."""
        got = self.report()
        logger.info("topology: %s", got)
        gpus, pool = got["gpus"], got["pool"]
        if isinstance(gpus, list) and isinstance(pool, dict):
            local = {int(n) for n in pool["pages_by_node"]}
            far = [g["device"] for g in gpus if g["numa_node"] not in (None, *local)]
            if far and len(got["nodes"]) > 1:  # type: ignore[arg-type]
                logger.warning(
                    "GPU(s) %s sit on another NUMA node than the pool's pages "
                    "(%s): their copies cross the socket link; start the server "
                    "under numactl --interleave=all, or one server per socket "
                    "with --membind and --devices (docs/operations.md)",
                    far,
                    pool["pages_by_node"],
                )
        return got
