"""Readers' channels to owners' Peer services, and the endpoint string a node
advertises: where its Peer RPCs go and where its transfer engine serves reads."""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from pegaflow.common import peer_auth
from pegaflow.common.channels import RECONNECT
from pegaflow.proto import peer_pb2 as pb
from pegaflow.proto import peer_pb2_grpc as pb_grpc

MAX_CHANNELS = 256  # owners a node keeps a channel to; the oldest goes first
CLOSE_GRACE_S = 5.0  # calls in flight on a replaced channel may end meanwhile


@dataclass(slots=True)
class _Channel:
    channel: grpc.aio.Channel
    stub: pb_grpc.PeerStub
    incarnation: int  # of the owner it was made for (0: unknown)


def _close_soon(channel: grpc.aio.Channel) -> None:
    asyncio.ensure_future(channel.close(CLOSE_GRACE_S))


@dataclass(frozen=True, slots=True)
class Endpoint:
    rpc: str  # host:port of the owner's pegaflow-server (its Peer service)
    transfer: str  # host:port of its transfer engine

    def __str__(self) -> str:
        return f"rpc={self.rpc};te={self.transfer}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """ValueError on anything but rpc=HOST:PORT;te=HOST:PORT, HOST a DNS
        name, an IPv4 address or a bracketed IPv6 one (it came from the
        network: a grpc target such as unix:/path must never be dialled)."""
        parts = [part.partition("=") for part in text.split(";")]
        fields = {key: value for key, sep, value in parts if sep}
        if len(parts) != 2 or set(fields) != {"rpc", "te"}:
            raise ValueError(f"endpoint: {text!r} is not rpc=HOST:PORT;te=HOST:PORT")
        for key in ("rpc", "te"):
            if not _host_port(fields[key]):
                raise ValueError(f"endpoint: {key}={fields[key]!r} is not HOST:PORT")
        return cls(fields["rpc"], fields["te"])


_DNS_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")  # fmt: skip


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    try:
        if host.startswith("[") and host.endswith("]"):
            return ipaddress.ip_address(host[1:-1]).version == 6
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return _DNS_NAME.fullmatch(host) is not None


class PeerChannels:
    """grpc.aio stubs by owner address, on the event loop. A channel serves
    one incarnation of its owner: an owner that restarted (a new incarnation
    in the metaserver's plan) gets a new channel, since the old one may sit
    in gRPC's reconnect backoff after the old process died, failing every
    call at once for up to minutes while the new process serves."""

    def __init__(self, token: str | None) -> None:
        self._metadata = peer_auth.metadata(token)
        self._stubs: OrderedDict[str, _Channel] = OrderedDict()

    def _stub(self, addr: str, incarnation: int | None = None) -> pb_grpc.PeerStub:
        """The owner's stub; with `incarnation`, a new channel when the one
        held was made for another."""
        got = self._stubs.get(addr)
        if got is not None and incarnation not in (None, got.incarnation):
            del self._stubs[addr]
            _close_soon(got.channel)
            got = None
        if got is not None:
            self._stubs.move_to_end(addr)
            return got.stub
        if len(self._stubs) >= MAX_CHANNELS:
            _, old = self._stubs.popitem(last=False)
            _close_soon(old.channel)
        options = [*RECONNECT, ("grpc.max_receive_message_length", 64 << 20)]
        channel = grpc.aio.insecure_channel(addr, options=options)
        held = _Channel(channel, pb_grpc.PeerStub(channel), incarnation or 0)
        self._stubs[addr] = held
        return held.stub

    async def pin(
        self,
        addr: str,
        request: pb.PinRequest,
        timeout_s: float,
        incarnation: int | None = None,
    ) -> pb.PinResponse:
        """A fetch's first call to the owner: `incarnation` (the plan's)
        picks the channel."""
        return await self._stub(addr, incarnation).Pin(
            request, timeout=timeout_s, metadata=self._metadata
        )

    async def checksums(self, addr: str, pin_id: int, timeout_s: float) -> bytes:
        got = await self._stub(addr).Checksums(
            pb.ChecksumsRequest(pin_id=pin_id), timeout=timeout_s,
            metadata=self._metadata,
        )  # fmt: skip
        return got.checksums

    async def release(self, addr: str, pin_id: int, timeout_s: float) -> bool:
        got = await self._stub(addr).Release(
            pb.ReleaseRequest(pin_id=pin_id), timeout=timeout_s, metadata=self._metadata
        )
        return got.released

    async def close(self) -> None:
        for held in self._stubs.values():
            await held.channel.close()
        self._stubs.clear()
