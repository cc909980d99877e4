"""The uid owning one TCP socket of this host, asked of the kernel by its
address pair (NETLINK_SOCK_DIAG, one exact lookup: the kernel's hash lookup
of that connection, tens of microseconds).

/proc/net/tcp answers the same, but the kernel walks its whole connection
table to write it: 4.3 ms a read on the dev VM with 13 sockets open, too slow
for a check on every query (pegaflow.common.identity keeps it as the fallback).
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
ALL_STATES = 0xFFFFFFFF
NO_COOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2 up to its sockid
_UID_AT = _HEADER.size + 4 + 48 + 12  # inet_diag_msg: after the sockid, 3 u32s
_seq = itertools.count(1)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _sockid(local: tuple[Address, int], remote: tuple[Address, int]) -> bytes:
    (src, sport), (dst, dport) = local, remote
    pad = bytes(16 - len(src.packed))
    return (
        struct.pack("!HH", sport, dport)
        + src.packed + pad
        + dst.packed + pad
        + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE)
    )  # fmt: skip


def tcp_socket_uid(
    local: tuple[Address, int], remote: tuple[Address, int]
) -> int | None:
    """The uid of the TCP socket whose own address is `local` and whose peer
    is `remote` (both IPv4 or both IPv6; v4-mapped IPv6 finds IPv4 sockets
    too); None if there is none. OSError where netlink is unavailable."""
    if local[0].version != remote[0].version:
        raise ValueError("local and remote: need one IP version")
    family = socket.AF_INET if local[0].version == 4 else socket.AF_INET6
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, ALL_STATES)
    body += _sockid(local, remote)
    seq = next(_seq)
    msg = _HEADER.pack(
        _HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(msg + body, (0, 0))
        while True:
            reply = nl.recv(8192)
            _, kind, _, got_seq, _ = _HEADER.unpack_from(reply)
            if got_seq == seq:
                break
    if kind == NLMSG_ERROR:
        return None  # -ENOENT: no such connection
    if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _UID_AT + 4:
        raise OSError(f"sock_diag: unexpected reply type {kind}")
    return struct.unpack_from("=I", reply, _UID_AT)[0]
