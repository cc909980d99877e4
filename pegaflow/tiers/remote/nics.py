"""--nics: every named RDMA device must exist and have an active port.

Mooncake falls back to TCP, silently, when it finds no usable HCA: a cluster
meant to read at 400 Gb/s would then crawl at socket speed with nothing said.
So the server opens each named device itself (pyverbs where installed, the
kernel's sysfs view otherwise) and refuses to start on one without an active
port, naming it.
"""

from __future__ import annotations

from pathlib import Path

SYSFS = Path("/sys/class/infiniband")
_ACTIVE = 4  # IBV_PORT_ACTIVE


class NicError(ValueError):
    """A --nics entry that cannot carry RDMA traffic."""


def check_nics(names: tuple[str, ...], sysfs: Path = SYSFS) -> None:
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise NicError(f"--nics: {name!r} is not an RDMA device name")
        if not (sysfs / name).exists():
            present = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []
            raise NicError(
                f"--nics: no RDMA device {name!r} (present: "
                f"{', '.join(present) or 'none'}); drop --nics to use TCP"
            )
        if not _active_port(name, sysfs):
            raise NicError(
                f"--nics: {name} has no active port (check the link with "
                f"`ibv_devinfo -d {name}`); drop --nics to use TCP"
            )


def _active_port(name: str, sysfs: Path) -> bool:
    try:
        from pyverbs.device import Context
    except ImportError:
        return _active_in_sysfs(name, sysfs)
    try:
        with Context(name=name) as ctx:
            ports = ctx.query_device().phys_port_cnt
            return any(ctx.query_port(p).state == _ACTIVE for p in range(1, ports + 1))
    except Exception:  # pyverbs raises its own PyverbsRDMAError on a dead device
        return False


def _active_in_sysfs(name: str, sysfs: Path) -> bool:
    """ports/N/state reads e.g. '4: ACTIVE'."""
    ports = sysfs / name / "ports"
    if not ports.is_dir():
        return False
    for state in ports.glob("*/state"):
        try:
            if state.read_text().split(":", 1)[0].strip() == str(_ACTIVE):
                return True
        except OSError:
            continue
    return False


def active_devices(sysfs: Path = SYSFS) -> list[str]:
    """Devices with an active port (the rdma-marked tests run on these)."""
    if not sysfs.is_dir():
        return []
    return sorted(p.name for p in sysfs.iterdir() if _active_in_sysfs(p.name, sysfs))
