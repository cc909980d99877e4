"""Who is asking: the kernel's word, never the request's.

On the unix socket, SO_PEERCRED names the connecting process and its uid. On
TCP from this host (loopback, or one of the host's own addresses) the kernel
still knows the uid that owns the client's socket (NETLINK_SOCK_DIAG, or
/proc/net/tcp), but not which process holds it; a socket of another host or
network namespace it does not know at all (`peer_on_host` is False). A
registration that lets the server read or write a process's host memory is
accepted only for a process the kernel vouches for: the caller itself on the
socket; with --allow-tcp-host-engines, a process of the caller's uid over TCP
from this host. These checks are of the process as it is when it registers;
that it still runs that program with those rights is checked again before
every copy (pegaflow.common.pidfds.ProcessImage: an exec ends a registration).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Literal

from .errors import InvalidRequest, Overloaded, PermissionDenied
from .pidfds import NO_DESCRIPTOR
from .sock_diag import tcp_socket_uid

logger = logging.getLogger(__name__)

Transport = Literal["unix", "tcp"]
UNKNOWN = -1
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
_TCP_HINT = (
    "register over the server's unix socket (the client does so when it runs "
    "on this host as the server's user or root), or start the server with "
    "--allow-tcp-host-engines if every local user may be trusted"
)


@dataclass(frozen=True, slots=True)
class Caller:
    """The process behind a request, as far as the kernel told us."""

    transport: Transport
    pid: int = UNKNOWN  # known on the unix socket only
    uid: int = UNKNOWN  # unix socket; TCP from this host when looked up

    @property
    def label(self) -> str:
        who = f"pid {self.pid}" if self.pid != UNKNOWN else "a TCP client"
        return who if self.uid == UNKNOWN else f"{who} (uid {self.uid})"


def unix_peer(sock: socket.socket) -> Caller:
    pid, uid, _ = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return Caller("unix", pid, uid)


def tcp_peer(peer: str, server_port: int) -> Caller:
    """A gRPC peer string ('ipv4:127.0.0.1:5432', 'ipv6:[::1]:5432'), with the
    uid owning its socket when the connection comes from this host: over
    loopback, or from one of the host's own addresses (a client of the
    server's routable --addr on the same host)."""
    parsed = _peer_address(peer)
    if parsed is None:
        return Caller("tcp")
    addr, port = parsed
    if not addr.is_loopback:
        uid = _diag_uid(addr, port, server_port, loopback_too=False)
        return Caller("tcp", UNKNOWN, UNKNOWN if uid is None else uid)
    return Caller("tcp", UNKNOWN, _loopback_uid(addr, port, server_port))


def peer_on_host(peer: str, server_port: int) -> bool:
    """Whether the kernel places a gRPC peer on this host: a loopback address
    (no lookup needed), or a socket of this network namespace connected to
    the server from one of its own addresses."""
    parsed = _peer_address(peer)
    if parsed is None:
        return False
    addr, port = parsed
    if addr.is_loopback:
        return True
    return _diag_uid(addr, port, server_port, loopback_too=False) is not None


def _peer_address(
    peer: str,
) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """A TCP peer's address (an IPv4 one where a dual-stack listener shows it
    v4-mapped) and port; None for anything else."""
    family, _, rest = peer.partition(":")
    host, _, port = rest.rpartition(":")
    if family not in ("ipv4", "ipv6"):
        return None
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
        port_no = int(port)
    except ValueError:
        return None
    return getattr(addr, "ipv4_mapped", None) or addr, port_no


def _loopback_uid(
    addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port_no: int, server_port: int
) -> int:
    v4 = addr if addr.version == 4 else None
    uid = _diag_uid(addr, port_no, server_port)
    if uid is not None:
        return uid
    # Either side may hold an IPv6 socket with a v4-mapped address (gRPC does).
    if v4 is None:
        tables = [("/proc/net/tcp6", addr)]
    else:
        tables = [
            ("/proc/net/tcp", v4),
            ("/proc/net/tcp6", ipaddress.IPv6Address(f"::ffff:{v4}")),
        ]
    for table, local in tables:
        uid = _socket_uid(table, f"{_proc_addr(local)}:{port_no:04X}", server_port)
        if uid != UNKNOWN:
            return uid
    return UNKNOWN


def _diag_uid(
    client: ipaddress.IPv4Address | ipaddress.IPv6Address,
    port: int,
    server_port: int,
    loopback_too: bool = True,
) -> int | None:
    """The kernel's one-connection lookup (pegaflow.common.sock_diag) of the client's
    socket, toward the client's own address (what a client of 127.0.0.1, ::1
    or this host's own address connects from and to) or the usual loopback
    one; None when that finds nothing (a socket of another host or network
    namespace is not in this one's table) or netlink is unavailable (the
    caller scans /proc then, for loopback peers). An IPv4 lookup finds IPv6
    sockets with v4-mapped addresses too."""
    usual = ipaddress.ip_address("127.0.0.1" if client.version == 4 else "::1")
    servers = (client, usual) if loopback_too else (client,)
    try:
        for server in dict.fromkeys(servers):
            uid = tcp_socket_uid((client, port), (server, server_port))
            if uid is not None:
                return uid
    except OSError as exc:
        if exc.errno in NO_DESCRIPTOR:
            raise _no_lookup(exc) from exc
        _netlink_refused(str(exc))
        return None
    return None


def _no_lookup(exc: OSError) -> Overloaded:
    """Out of descriptors or memory this moment: the caller's uid cannot be
    looked up now, which says nothing about who it is (not "another host",
    not "netlink is unavailable" for good)."""
    logger.warning("cannot look up a TCP caller's uid now: %s", exc)
    return Overloaded(
        "caller: the server cannot open a descriptor to learn which user is "
        f"asking now ({exc.strerror}); retry later"
    )


@functools.cache
def _netlink_refused(reason: str) -> None:
    """Said once per reason: each loopback gRPC caller is then looked up by
    scanning /proc/net/tcp, milliseconds a call on the event loop."""
    logger.warning(
        "NETLINK_SOCK_DIAG unavailable (%s): loopback callers' uids come from "
        "/proc/net/tcp, slower; queries over the unix socket are not affected",
        reason,
    )


def _socket_uid(table: str, local: str, server_port: int) -> int:
    """The uid of the established socket at `local` talking to server_port."""
    try:
        with open(table) as f:
            rows = f.read().splitlines()[1:]
    except OSError as exc:
        if exc.errno in NO_DESCRIPTOR:
            raise _no_lookup(exc) from exc
        return UNKNOWN
    for row in rows:
        cols = row.split()
        if (
            len(cols) > 7
            and cols[1] == local
            and cols[2].endswith(f":{server_port:04X}")
            and cols[3] == "01"  # ESTABLISHED
        ):
            return int(cols[7])
    return UNKNOWN


def _proc_addr(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """An address as /proc/net/tcp{,6} spells it: 32-bit words in host order."""
    raw = addr.packed
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    return "".join(f"{int.from_bytes(w, 'little'):08X}" for w in words)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    tgid: int
    uid: int  # effective uid: whose rights the process holds
    uids: tuple[int, ...] = ()  # real, effective, saved, filesystem
    gids: tuple[int, ...] = ()
    cap_eff: int = 0
    proc_uid: int = -1  # owner of /proc/<pid>/status: root when not dumpable


def process_info(pid: int, field: str) -> ProcessInfo:
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
            proc_uid = os.fstat(f.fileno()).st_uid
    except (FileNotFoundError, ProcessLookupError):
        raise InvalidRequest(f"{field}: process {pid} does not exist") from None
    values = dict(line.split(":", 1) for line in lines if ":" in line)
    try:
        tgid = int(values["Tgid"])
        uids = tuple(int(x) for x in values["Uid"].split())
        gids = tuple(int(x) for x in values["Gid"].split())
        cap_eff = int(values["CapEff"], 16)
    except (KeyError, IndexError, ValueError):
        raise InvalidRequest(f"{field}: cannot read /proc/{pid}/status") from None
    return ProcessInfo(tgid, uids[1], uids, gids, cap_eff, proc_uid)


def _not_plainly_the_callers(info: ProcessInfo, uid: int) -> str:
    """Why a process named over TCP is not one the caller could ptrace itself
    ("" when it is): the kernel's own test, which a root server bypasses. A
    setuid or setgid transition, file capabilities or a non-dumpable process
    must not become writable through the server."""
    if any(u != uid for u in info.uids):
        return f"its uids (real, effective, saved, fs) are {info.uids}"
    if len(set(info.gids)) != 1:
        return f"its gids (real, effective, saved, fs) differ: {info.gids}"
    if info.cap_eff and uid != 0:
        return f"it holds capabilities ({info.cap_eff:#x})"
    if info.proc_uid != uid:
        return "it is not dumpable (setuid, setgid or PR_SET_DUMPABLE)"
    return ""


def check_host_memory_owner(
    pid: int, caller: Caller, field: str, allow_tcp: bool
) -> None:
    """Refuse to let `caller` register host memory of `pid` unless the kernel
    vouches that pid is the caller (unix socket) or, over TCP when allowed, a
    process of the caller's own uid. Never the server, never a thread id."""
    if pid <= 0:
        raise InvalidRequest(f"{field}: {pid} is not a process id")
    if caller.transport == "tcp" and not allow_tcp:
        raise PermissionDenied(
            f"{field}: host-memory registration over TCP is refused: the server "
            f"cannot tell which process is asking; {_TCP_HINT}"
        )
    info = process_info(pid, field)
    server = os.getpid()
    if pid == server or info.tgid == server:
        raise PermissionDenied(f"{field}: {pid} is the server itself, not an engine")
    if info.tgid != pid:
        raise PermissionDenied(
            f"{field}: {pid} is a thread of process {info.tgid}, not a process; "
            "register the process id (os.getpid())"
        )
    if caller.transport == "unix" and pid != caller.pid:
        raise PermissionDenied(
            f"{field}: {pid} is not the calling process ({caller.pid}); an engine "
            "registers its own memory"
        )
    if caller.uid == UNKNOWN:
        raise PermissionDenied(
            f"{field}: the server cannot tell which user is asking (not a "
            f"connection from this host); {_TCP_HINT}"
        )
    if info.uid != caller.uid:
        raise PermissionDenied(
            f"{field}: process {pid} runs as uid {info.uid}, the caller as uid "
            f"{caller.uid}: the server reads memory only with the caller's rights"
        )
    tcp = caller.transport == "tcp"
    why = _not_plainly_the_callers(info, caller.uid) if tcp else ""
    if why:
        raise PermissionDenied(
            f"{field}: process {pid} is not plainly uid {caller.uid}'s: {why}; "
            "register from the engine itself over the unix socket"
        )


@dataclass(frozen=True, slots=True)
class CallContext:
    """What the transport knows of a request beside its fields."""

    caller: Caller
    owner_token: bytes = b""
    deadline: float | None = None  # time.monotonic() seconds; None: none
