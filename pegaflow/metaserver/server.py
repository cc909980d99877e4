"""Metaserver assembly: directory + gRPC + HTTP, the sweep loop, serve()."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pegaflow.config import parse_addr
from pegaflow.http import bind_http, serve_http
from pegaflow.metaserver.config import MAX_MESSAGE_BYTES, MetaConfig
from pegaflow.metaserver.directory import Directory
from pegaflow.metaserver.metrics import MetaMetrics
from pegaflow.metaserver.service import MetaInterceptor, MetaServicer
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc
from pegaflow.startup import StartupError, bind_error, bind_failed

logger = logging.getLogger(__name__)

SERVICE_NAME = "pegaflow.meta.v1.MetaServer"


@dataclass(slots=True)
class RunningMetaServer:
    grpc_server: grpc.aio.Server
    port: int
    http: ThreadingHTTPServer | None
    directory: Directory
    sweeper: asyncio.Task | None = None

    @property
    def http_port(self) -> int | None:
        return self.http.server_address[1] if self.http else None

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        await self.grpc_server.stop(grace_s)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()


async def create_server(config: MetaConfig) -> RunningMetaServer:
    """Bind gRPC (port 0 picks one) and HTTP, start serving and sweeping."""
    directory = Directory(config)
    metrics = MetaMetrics(directory)
    server, port = _bind_grpc(config, metrics)
    http = None
    if config.http_addr is not None:
        host, http_port = parse_addr(config.http_addr)
        try:
            http = bind_http(host, http_port)
        except OSError as exc:
            await server.stop(None)
            raise bind_failed("--http-addr", config.http_addr, exc) from None
    pb_grpc.add_MetaServerServicer_to_server(MetaServicer(directory), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if http is not None:
        serve_http(http, metrics.registry, _health_report(directory))
    running = RunningMetaServer(server, port, http, directory)
    running.sweeper = asyncio.create_task(_sweep_forever(directory))
    return running


def _bind_grpc(config: MetaConfig, metrics: MetaMetrics) -> tuple[grpc.aio.Server, int]:
    host, port = parse_addr(config.addr)
    if (error := bind_error("--addr", config.addr, host, port)) is not None:
        raise error
    server = grpc.aio.server(
        interceptors=[MetaInterceptor(metrics, config.token)],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise StartupError(f"--addr: cannot listen on {config.addr}; try again")
    return server, bound


def _health_report(directory: Directory):  # noqa: ANN202 - the HTTP thread's
    started = time.monotonic()

    def report() -> dict[str, object]:
        index = directory.index
        return {  # counts only: never a namespace or a hash
            "status": "ok",
            "uptime_s": round(time.monotonic() - started, 1),
            "nodes": len(directory.nodes),
            "entries": index.entries,
            "max_entries": index.max_entries,
            "blocks": index.blocks,
            "namespaces": index.namespaces,
            "token_required": directory.config.token is not None,
        }

    return report


async def _sweep_forever(directory: Directory) -> None:
    interval = directory.config.sweep_interval_s
    while True:
        await asyncio.sleep(interval)
        try:
            directory.sweep()
        except Exception:  # a background loop must survive any one bad sweep
            logger.exception("sweep failed")


async def serve(config: MetaConfig) -> None:
    """Run until SIGTERM/SIGINT; print one READY line for supervisors and tests."""
    running = await create_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, _ = parse_addr(config.addr)
    http = (
        f"{parse_addr(config.http_addr)[0]}:{running.http_port}"
        if running.http
        else "off"
    )
    print(f"READY grpc={host}:{running.port} http={http} pid={os.getpid()}", flush=True)
    logger.info(
        "metaserver on %s:%d (http %s, token %s)",
        host,
        running.port,
        http,
        "required" if config.token else "off",
    )
    await stop.wait()
    logger.info("stopping")
    with contextlib.suppress(asyncio.CancelledError):
        await running.stop()
    logger.info("stopped")
