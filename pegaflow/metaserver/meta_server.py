"""Metaserver assembly: directory + gRPC + HTTP, the sweep thread, serve().

gRPC's synchronous server with a small thread pool: every RPC is a short,
CPU-bound step under the Directory's one lock, and grpcio's sync path answers
a unary call sooner than grpc.aio does (benchmarks/RESULTS.md, "dev VM,
2026-12-02: sync server, cheaper plan")."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pegaflow.common.settings import parse_addr
from pegaflow.daemon.http_endpoint import bind_http, serve_http
from pegaflow.daemon.startup import StartupError, bind_error, bind_failed
from pegaflow.proto import metaserver_pb2_grpc as pb_grpc

from .directory import Directory
from .meta_config import MAX_MESSAGE_BYTES, MetaConfig
from .meta_metrics import MetaMetrics
from .meta_service import MetaInterceptor, MetaServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = "pegaflow.meta.v1.MetaServer"
# Handler threads. The work is serialised by the Directory's lock (and the
# GIL), so more threads would only queue there; a few keep one slow client's
# unary call from holding up the rest. Health Watch streams take none (they
# run non-blocking on grpc_health's own callbacks).
GRPC_WORKERS = 8


@dataclass(slots=True)
class RunningMetaServer:
    grpc_server: grpc.Server
    port: int
    http: ThreadingHTTPServer | None
    directory: Directory
    stopping: threading.Event = field(default_factory=threading.Event)
    sweeper: threading.Thread | None = None

    @property
    def http_port(self) -> int | None:
        return self.http.server_address[1] if self.http else None

    def stop(self, grace_s: float = 1.0) -> None:
        self.stopping.set()
        self.grpc_server.stop(grace_s).wait()
        if self.sweeper is not None:
            self.sweeper.join()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()


def create_server(config: MetaConfig) -> RunningMetaServer:
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
            server.stop(None)
            raise bind_failed("--http-addr", config.http_addr, exc) from None
    pb_grpc.add_MetaServerServicer_to_server(MetaServicer(directory), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if http is not None:
        serve_http(http, metrics.registry, _health_report(directory))
    running = RunningMetaServer(server, port, http, directory)
    running.sweeper = threading.Thread(
        target=_sweep_forever,
        args=(directory, running.stopping),
        name="meta-sweep",
        daemon=True,
    )
    running.sweeper.start()
    return running


def _bind_grpc(config: MetaConfig, metrics: MetaMetrics) -> tuple[grpc.Server, int]:
    host, port = parse_addr(config.addr)
    if (error := bind_error("--addr", config.addr, host, port)) is not None:
        raise error
    server = grpc.server(
        futures.ThreadPoolExecutor(GRPC_WORKERS, thread_name_prefix="meta-grpc"),
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


def _sweep_forever(directory: Directory, stopping: threading.Event) -> None:
    interval = directory.config.sweep_interval_s
    while not stopping.wait(interval):
        try:
            directory.sweep()
        except Exception:  # a background loop must survive any one bad sweep
            logger.exception("sweep failed")


def serve(config: MetaConfig) -> None:
    """Run until SIGTERM/SIGINT; print one READY line for supervisors and tests."""
    running = create_server(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
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
    stop.wait()
    logger.info("stopping")
    running.stop()
    logger.info("stopped")
