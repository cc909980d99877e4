"""The remote tier's settings, validated once (the CLI builds it from
--metaserver-addr, --nics, --remote-transport, --peer-token-*)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Literal

from pegaflow.common.peer_auth import check_token
from pegaflow.common.settings import check_int, check_seconds, parse_addr

RemoteProtocol = Literal["tcp", "rdma"]


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    metaserver_addr: str  # host:port (an http:// prefix is accepted and dropped)
    protocol: RemoteProtocol = "tcp"
    nics: tuple[str, ...] = ()
    token: str | None = None
    node_id: str = ""  # "": the server's --addr, which must be routable
    # A query waits this long for the metaserver's plan, then answers `loading`
    # (the plan is awaited in the background, up to fetch_timeout_s).
    query_timeout_s: float = 0.05
    # A fetch (plan, pin, read, check, publish) that takes longer is abandoned: its
    # blocks become misses (their slots are freed once the read has returned).
    fetch_timeout_s: float = 10.0
    # A failed or empty metaserver answer for a prefix is remembered this long,
    # so the engine's next poll of the same prefix is answered at once.
    negative_ttl_s: float = 2.0
    # Slots of a read that failed with bytes possibly in flight stay out of use
    # this long; None: from Mooncake's timeouts (transport.quarantine_s).
    quarantine_s: float | None = None
    max_advertise_queue: int = 1 << 20  # hashes waiting for the metaserver
    # Peers on this one host only (the demo, trying it out): --addr may be
    # loopback. Never set where peers are other machines.
    allow_loopback: bool = False

    def __post_init__(self) -> None:
        try:
            parse_addr(self.metaserver_host_port)
        except ValueError as exc:
            raise ValueError(f"metaserver_addr: {exc}") from None
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"remote_transport: {self.protocol!r}, need tcp or rdma")
        if self.protocol == "rdma" and not self.nics:
            raise ValueError("remote_transport: rdma needs --nics naming the devices")
        if self.token is not None:
            check_token(self.token)
        check_seconds("remote_query_timeout_s", self.query_timeout_s, 10.0)
        check_seconds("remote_fetch_timeout_s", self.fetch_timeout_s, 120.0)
        check_seconds("remote_negative_ttl_s", self.negative_ttl_s, 3600.0, True)
        if self.quarantine_s is not None:
            check_seconds("remote_quarantine_s", self.quarantine_s, 3600.0)
        check_int("max_advertise_queue", self.max_advertise_queue, 1, 1 << 28)

    @property
    def metaserver_host_port(self) -> str:
        return self.metaserver_addr.removeprefix("http://").rstrip("/")


def check_routable(addr: str, allow_loopback: bool = False) -> str:
    """--addr is what peers are told to reach this node at: it must name one
    interface that other hosts can route to. Returns the host. ValueError says
    why a wildcard or loopback address cannot be advertised."""
    host, _ = parse_addr(addr)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            raise ValueError(f"--addr: cannot resolve {host!r}") from None
    if ip.is_unspecified:
        raise ValueError(
            f"--addr {addr}: peers read this node at the address it advertises, "
            "and a wildcard names no host; give this node's address "
            "(e.g. --addr 10.0.0.5:50055)"
        )
    if ip.is_loopback and not allow_loopback:
        raise ValueError(
            f"--addr {addr}: with --metaserver-addr peers on other hosts read "
            "this node at its --addr, and loopback reaches only this host; give "
            "an address of this node they can route to (or, to try peers on one "
            "host, --remote-allow-loopback)"
        )
    return host
