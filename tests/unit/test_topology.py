"""pegaflow.common.topology: GPU -> NUMA node from a sysfs tree (a fake one in
a tmp dir: this machine has one node and no GPU), and the pool's pages from a
real move_pages call on this process's own memory."""

from __future__ import annotations

import ctypes
import errno
import logging
import platform
import threading
from pathlib import Path

import numpy as np
import pytest

from pegaflow.common import topology

BUSES = {0: "0000:18:00.0", 1: "0000:3b:00.0", 2: "0000:86:00.0", 3: "0000:af:00.0"}


def fake_sysfs(root: Path, nodes: dict[str, str], online: str = "0-1") -> Path:
    """/sys with PCI devices `nodes` (bus id -> numa_node text) and `online`."""
    for bus, node in nodes.items():
        dev = root / "bus/pci/devices" / bus
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(node + "\n")
    (root / "devices/system/node").mkdir(parents=True)
    (root / "devices/system/node/online").write_text(online + "\n")
    return root


def test_each_gpu_gets_the_node_sysfs_names(tmp_path: Path) -> None:
    """Two GPUs per socket on a two-socket host; -1 (no affinity) and a
    device sysfs lacks are unknown, never node 0."""
    sysfs = fake_sysfs(
        tmp_path, {BUSES[0]: "0", BUSES[1]: "0", BUSES[2]: "1", BUSES[3]: "-1"}
    )
    places = topology.gpu_places([0, 1, 2, 3, 4], _bus_of, sysfs)
    assert [(p.ordinal, p.numa_node) for p in places] == [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, None),
        (4, None),  # 0000:d8:00.0 has no entry
    ]
    assert places[2].bus_id == "0000:86:00.0"
    assert topology.online_nodes(sysfs) == [0, 1]


def _bus_of(ordinal: int) -> str:
    return BUSES.get(ordinal, "0000:d8:00.0")


def test_bus_ids_are_written_as_sysfs_names_them(tmp_path: Path) -> None:
    """CUDA's attributes are numbers; sysfs's names are lower-case hex."""
    assert topology.bus_id(0, 0xAF, 0) == "0000:af:00.0"
    assert topology.bus_id(1, 0x3B, 0x1F, 1) == "0001:3b:1f.1"
    sysfs = fake_sysfs(tmp_path, {"0000:af:00.0": "1"})
    assert topology.numa_node_of("0000:AF:00.0", sysfs) == 1


@pytest.mark.parametrize(
    ("text", "nodes"), [("0", [0]), ("0-1", [0, 1]), ("0,2-3", [0, 2, 3])]
)
def test_node_lists(text: str, nodes: list[int]) -> None:
    assert topology.parse_node_list(text) == nodes
    assert topology._ranges(nodes) == text


def test_move_pages_finds_this_process_pages_on_this_machines_node() -> None:
    """A touched buffer's pages are all on an online node, a never-mapped
    address is refused per page (-EFAULT), all in one call."""
    buf = np.ones(8 << 20, np.uint8)  # touched: every page present
    place = topology.pool_place(buf.ctypes.data, buf.nbytes, samples=300)
    assert place.sampled == 300 and place.not_present == 0
    assert sum(count for _, count in place.by_node) == 300
    assert {node for node, _ in place.by_node} <= set(topology.online_nodes())
    status = topology.page_nodes(np.array([buf.ctypes.data, 4096], np.uint64))
    assert status[0] >= 0 and status[1] == -errno.EFAULT


def test_untouched_pages_are_not_present() -> None:
    """An anonymous mapping never written has no pages yet (-ENOENT): an
    unpinned pool before pre-touch reports them as such, not as node 0."""
    import mmap

    area = mmap.mmap(-1, 64 << 12)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(area))
        place = topology.pool_place(base, len(area), samples=64)
        assert place.not_present == 64 and place.by_node == ()
        area[0:1] = b"x"  # one page faulted in
        place = topology.pool_place(base, len(area), samples=64)
        assert place.not_present == 63
    finally:
        del base  # the buffer export must go before the mapping closes
        area.close()


SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


@pytest.mark.skipif(platform.machine() not in SET_MEMPOLICY, reason="syscall no.")
@pytest.mark.parametrize(("mode", "name"), [(2, "bind 0"), (3, "interleave 0")])
def test_memory_policy_names_what_numactl_would_set(mode: int, name: str) -> None:
    """set_mempolicy on a thread of our own (the policy is per thread, so
    pytest's keeps its own), then get_mempolicy reads it back."""
    got: list[str] = []

    def run() -> None:
        mask = ctypes.c_ulong(1)  # node 0: every Linux machine has it
        libc = ctypes.CDLL(None, use_errno=True)
        nr = SET_MEMPOLICY[platform.machine()]
        rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(mode), ctypes.byref(mask),
                          ctypes.c_ulong(64))  # fmt: skip
        got.append(
            topology.memory_policy() if rc == 0 else f"errno {ctypes.get_errno()}"
        )

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert got == [name]
    assert topology.memory_policy() == "default"


def test_the_report_and_the_start_up_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """/stats' entry names every GPU's node and the pool's pages by node; the
    start-up log warns when a GPU's node holds none of the pool (this
    process's pages are on node 0; the fake GPU 2 on node 1)."""
    sysfs = fake_sysfs(tmp_path, {BUSES[0]: "0", BUSES[2]: "1"})
    buf = np.ones(1 << 20, np.uint8)
    placement = topology.Placement([0, 2], buf.ctypes.data, buf.nbytes, _bus_of, sysfs)
    with caplog.at_level(logging.INFO, logger=topology.__name__):
        got = placement.log()
    assert got["nodes"] == [0, 1]
    assert got["gpus"] == [
        {"device": 0, "bus_id": BUSES[0], "numa_node": 0},
        {"device": 2, "bus_id": BUSES[2], "numa_node": 1},
    ]
    pool = got["pool"]  # 256 pages, or 257: numpy aligns to 64 bytes, not a page
    assert pool["pages_by_node"] == {"0": pool["sampled_pages"]}
    assert got["pool"]["policy"] == "default"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "[2]" in warned[0].getMessage()
    assert "numactl --interleave" in warned[0].getMessage()


def test_a_gpu_that_cannot_be_read_is_named_not_raised(tmp_path: Path) -> None:
    """No CUDA behind the ordinals: the report says why, the pool half stays."""

    def broken(ordinal: int) -> str:
        raise OSError(errno.ENODEV, "no such device")

    buf = np.ones(1 << 16, np.uint8)
    got = topology.Placement([0], buf.ctypes.data, buf.nbytes, broken).report()
    assert str(got["gpus"]).startswith("unknown:")
    assert got["pool"]["sampled_pages"] in (16, 17)
