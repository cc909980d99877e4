"""The server's whole configuration, built once by the CLI: its own addresses
and bounds, and each component's settings (pegaflow.common.settings for the
pool, engine and CUDA copies; pegaflow.gds for the SSD tier;
pegaflow.tiers.remote for peers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pegaflow.common.request_limits import (
    MAX_CONCURRENT_RPCS,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES_IN_FLIGHT,
)
from pegaflow.common.settings import (
    CudaConfig,
    EngineConfig,
    LogLevel,
    PoolConfig,
    check_int,
    parse_addr,
)
from pegaflow.gds import SsdConfig
from pegaflow.tiers.remote.remote_config import RemoteConfig


@dataclass(frozen=True, slots=True)
class ServerConfig:
    addr: str = "127.0.0.1:50055"
    http_addr: str | None = "127.0.0.1:9091"
    log_level: LogLevel = "info"
    pool: PoolConfig = field(default_factory=PoolConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)
    # Bounds checked by grpc before a message is parsed
    # (pegaflow.common.request_limits).
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS
    # Large request bodies worked on at once (RequestBytesBudget).
    max_request_bytes_in_flight: int = MAX_REQUEST_BYTES_IN_FLIGHT
    # Engine RPCs over gRPC from callers the kernel cannot place on this host
    # (other hosts, other network namespaces): refused unless set
    # (pegaflow.server.grpc_service.LocalEngines).
    allow_remote_engines: bool = False
    # Unix socket for fast prefix queries: a path, "auto" (a per-server path in
    # the temp directory) or None (off).
    socket: str | None = "auto"
    # The L3 SSD tier (pegaflow.gds.SsdConfig); None: off.
    ssd: SsdConfig | None = None
    # The L2 remote tier (pegaflow.tiers.remote.remote_config.RemoteConfig); None: off.
    remote: RemoteConfig | None = None

    def __post_init__(self) -> None:
        parse_addr(self.addr)
        if self.max_message_bytes < 1 << 16:
            raise ValueError("max_message_bytes: must be >= 64 KiB")
        check_int("max_concurrent_rpcs", self.max_concurrent_rpcs, 1, 1 << 20)
        check_int(
            "max_request_bytes_in_flight",
            self.max_request_bytes_in_flight,
            1 << 20,
            1 << 40,
        )
        if self.socket is not None and not self.socket.strip():
            raise ValueError("socket: empty; give a path, 'auto' or 'off'")
        if self.http_addr is not None:
            parse_addr(self.http_addr)
        # grpc takes the limit as a C int
        check_int("max_message_bytes", self.max_message_bytes, 1 << 20, (1 << 31) - 1)
