"""Nodes in their own network namespaces on one host, for the remote tier's
tests: a bridge in the root namespace, and per node a namespace joined to it by
a veth pair, with an address that exists only inside that namespace.

Every process of a node runs under `ip netns exec`; the test process (root
namespace) reaches them through the bridge. Made and removed by the fixture;
skipped, with the reason, where this process may not make namespaces.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    proc = subprocess.run(argv, capture_output=True, timeout=30)
    if proc.returncode != 0:
        raise NetnsUnavailable(
            f"{' '.join(argv)}: {proc.stderr.decode().strip() or proc.returncode}"
        )


@dataclass
class Node:
    name: str  # its namespace
    address: str  # its only routable address, inside the namespace
    device: str = ""  # its end of the veth pair (inside the namespace)

    def argv(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *command]

    def limit_rate(self, rate: str | None) -> None:
        """Shape what this node sends to `rate` (e.g. "200mbit"); None: lift it."""
        if rate is None:
            subprocess.run(self.argv("tc", "qdisc", "del", "dev", self.device, "root"),
                           capture_output=True)  # fmt: skip
            return
        subprocess.run(
            self.argv("tc", "qdisc", "add", "dev", self.device, "root", "tbf",
                      "rate", rate, "burst", "64kb", "latency", "2s"),
            check=True, capture_output=True,
        )  # fmt: skip


@dataclass
class Netns:
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    nodes: list[Node] = field(default_factory=list)
    _bridge: str = ""

    def __post_init__(self) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        # 10.X.Y.0/24, X and Y from the tag: parallel runs do not collide
        raw = int(self.tag, 16)
        self.subnet = f"10.{100 + (raw >> 8) % 100}.{raw & 0xFF}"
        self._bridge = f"pfbr{self.tag}"
        _ip("link", "add", self._bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
        except NetnsUnavailable:
            self.close()
            raise

    @property
    def host_address(self) -> str:
        """The root namespace's address on the bridge (where the tests run)."""
        return f"{self.subnet}.1"

    def add_node(self) -> Node:
        index = len(self.nodes) + 1
        name = f"pf{self.tag}n{index}"
        veth, inner = f"pv{self.tag}{index}", f"pv{self.tag}{index}i"
        address = f"{self.subnet}.{10 + index}"
        try:
            _ip("netns", "add", name)
            self.nodes.append(Node(name, address, inner))
            _ip("link", "add", veth, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", name)
            _ip("link", "set", veth, "master", self._bridge, "up")
            _ip("addr", "add", f"{address}/24", "dev", inner, ns=name)
            _ip("link", "set", inner, "up", ns=name)
            _ip("link", "set", "lo", "up", ns=name)
        except NetnsUnavailable:
            self.close()
            raise
        return self.nodes[-1]

    def close(self) -> None:
        for node in self.nodes:  # deleting the namespace deletes its veth end
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
        self.nodes.clear()
        if self._bridge:
            subprocess.run(["ip", "link", "del", self._bridge], capture_output=True)
            self._bridge = ""
