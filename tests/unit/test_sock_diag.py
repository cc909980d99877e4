"""The kernel's one-connection uid lookup (pegaflow.common.sock_diag) against real
loopback connections, and pegaflow.common.identity's use of it."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator

import pytest

from pegaflow.common import identity
from pegaflow.common.identity import tcp_peer
from pegaflow.common.sock_diag import tcp_socket_uid

V4 = ipaddress.ip_address("127.0.0.1")


@pytest.fixture
def connection() -> Iterator[tuple[tuple, tuple]]:
    """(client's own address, server's address) of one loopback connection."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with socket.create_connection(srv.getsockname()) as client:
            accepted, _ = srv.accept()
            with accepted:
                here = client.getsockname()
                yield (
                    (ipaddress.ip_address(here[0]), here[1]),
                    (V4, srv.getsockname()[1]),
                )


def test_the_kernel_names_the_connections_uid(connection) -> None:
    client, server = connection
    assert tcp_socket_uid(client, server) == os.geteuid()
    assert tcp_socket_uid(server, client) == os.geteuid()  # the accepted side
    assert tcp_socket_uid((client[0], 1), server) is None  # no such connection
    mapped = ipaddress.IPv6Address(f"::ffff:{client[0]}")
    assert tcp_socket_uid((mapped, client[1]), (ipaddress.IPv6Address(f"::ffff:{V4}"),
                          server[1])) == os.geteuid()  # fmt: skip
    with pytest.raises(ValueError, match="one IP version"):
        tcp_socket_uid((mapped, client[1]), server)


def test_a_loopback_peer_is_named_without_reading_proc(connection, monkeypatch) -> None:
    """/proc/net/tcp took 4.3 ms a read on the dev VM: a query must not."""
    client, server = connection

    def no_proc(*args: object) -> int:
        raise AssertionError("scanned /proc/net/tcp")

    monkeypatch.setattr(identity, "_socket_uid", no_proc)
    assert tcp_peer(f"ipv4:{client[0]}:{client[1]}", server[1]).uid == os.geteuid()
    mapped = f"ipv6:[::ffff:{client[0]}]:{client[1]}"
    assert tcp_peer(mapped, server[1]).uid == os.geteuid()


def test_without_netlink_the_proc_scan_still_answers(
    connection, monkeypatch, caplog
) -> None:
    client, server = connection

    def refused(*args: object) -> int:
        raise PermissionError("netlink refused by a seccomp filter")

    monkeypatch.setattr(identity, "tcp_socket_uid", refused)
    with caplog.at_level("WARNING", logger="pegaflow.common.identity"):
        for _ in range(3):
            peer = tcp_peer(f"ipv4:{client[0]}:{client[1]}", server[1])
            assert peer.uid == os.geteuid()
    said = [r for r in caplog.records if "NETLINK_SOCK_DIAG" in r.getMessage()]
    assert len(said) == 1  # once, not per caller


def test_a_peer_that_is_not_loopback_is_unknown() -> None:
    assert tcp_peer("ipv4:10.1.2.3:5000", 50055).uid == identity.UNKNOWN
    assert tcp_peer("unix:/tmp/x", 50055).uid == identity.UNKNOWN
