"""`pegaflow-server`: the daemon's command line, and `pegaflow-server status`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import logging.handlers
import queue
import sys
import time
from typing import TYPE_CHECKING

from pegaflow.cache.pool import HugepagesUnavailable, PoolTooLarge
from pegaflow.common.settings import (
    CudaConfig,
    EngineConfig,
    HitRateConfig,
    PoolConfig,
)
from pegaflow.daemon.startup import StartupError

from . import compat_flags, remote_flags, start_clock
from .server_config import ServerConfig
from .server_flags import build_parser, flag_message

if TYPE_CHECKING:
    from pegaflow.gds import SsdConfig

DEFAULT_SSD_CAPACITY = 512 << 30


def show_progress(args: argparse.Namespace) -> bool:
    """Bars on a terminal, or when asked: a service log gets no \\r frames."""
    if args.no_progress:
        return False
    return args.progress or sys.stderr.isatty()


# Checks the SSD flags' values when no tier is asked for; never opened.
UNUSED_SSD_PATH = "/nonexistent/pegaflow-ssd-flags-check"


def ssd_config(args: argparse.Namespace) -> SsdConfig | None:
    """The SSD tier's settings, None without --ssd-cache-path; its other flags
    are range-checked all the same, so a typo never starts a server quietly."""
    if args.ssd_cache_path is None and args.ssd_cache_capacity is not None:
        raise ValueError("--ssd-cache-capacity needs --ssd-cache-path")
    from pegaflow.gds import SsdConfig  # numpy: after argument errors

    threads: dict[str, int] = {}
    if args.ssd_write_inflight is not None:
        threads["write_threads"] = args.ssd_write_inflight
    if args.ssd_prefetch_inflight is not None:
        threads["read_threads"] = args.ssd_prefetch_inflight
    config = SsdConfig(
        paths=compat_flags.ssd_paths(
            args.ssd_cache_path or [UNUSED_SSD_PATH], args.ssd_cache_shards
        ),
        # the original's default; the free-space check names the flag
        capacity_bytes=DEFAULT_SSD_CAPACITY
        if args.ssd_cache_capacity is None
        else args.ssd_cache_capacity,
        backend=args.ssd_backend,
        direct_io=args.ssd_direct_io,
        admission=args.ssd_admission,
        write_on=args.ssd_write_on,
        gpu_direct=args.ssd_gpu_direct,
        queue_blocks=compat_flags.ssd_queue_blocks(args),
        on_mismatch=args.ssd_on_mismatch,
        show_progress=show_progress(args),
        **threads,
    )
    return config if args.ssd_cache_path is not None else None


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    pool_kwargs: dict[str, object] = {
        "size_bytes": args.pool_size,
        "use_hugepages": args.use_hugepages,
        "show_progress": show_progress(args),
        "pool_file": args.pool_file,
        "on_mismatch": args.pool_on_mismatch,
        "check_rate": args.pool_check_rate,
    }
    if args.prefault_threads is not None:
        pool_kwargs["prefault_threads"] = args.prefault_threads
    return ServerConfig(
        addr=args.addr,
        http_addr=None if args.no_http else args.http_addr,
        socket=None if args.socket == "off" else args.socket,
        log_level=args.log_level,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_request_bytes_in_flight=args.max_request_bytes_in_flight,
        allow_remote_engines=args.allow_remote_engines,
        pool=PoolConfig(**pool_kwargs),
        engine=EngineConfig(
            enable_lfu_admission=args.enable_lfu_admission,
            eviction=args.eviction,
            lease_ttl_s=args.lease_ttl,
            max_leased_share=args.max_leased_share,
            copy_threads=args.copy_threads,
            allow_tcp_host_engines=args.allow_tcp_host_engines,
            max_idle_namespaces=args.max_idle_namespaces,
            max_block_watchers=args.max_block_watchers,
            block_events_buffer=args.block_events_buffer,
            hit_rate=HitRateConfig(
                args.metric_hll_windows, args.metric_hll_bucket_bits
            ),
        ),
        cuda=CudaConfig(
            enabled=args.devices.enabled,
            devices=args.devices.devices,
            max_ctas=args.copy_ctas,
            event_timeout_s=args.cuda_event_timeout,
            copy_path=args.copy_path,
        ),
        ssd=ssd_config(args),
        remote=remote_flags.remote_config(args),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:  # a subcommand; every flag form stays the daemon's
        from .status_command import main as status_main

        return status_main(argv[1:])
    start_clock.mark("interpreter and imports")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_prometheus and args.no_http:
        parser.error("--enable-prometheus serves /metrics over HTTP: drop --no-http")
    warnings = compat_flags.ignored_warnings(args) + compat_flags.bucket_bits(args)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(flag_message(exc))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    listener = _log_off_the_loop()
    try:
        failed = _run(args, config, warnings)
    finally:
        listener.stop()  # every queued line written before the exit
    if failed is not None:
        print(f"pegaflow-server: {failed}", file=sys.stderr)  # names flag and fix
        return 2
    return 0


LOG_BACKLOG = 100_000  # log lines waiting for a stuck stderr, at most
FLUSH_S = 1.0  # flush() waits at most this long for a stuck stderr


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    def enqueue(self, record: logging.LogRecord) -> None:
        # stderr stuck: losing lines beats growing forever
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(record)

    def flush(self) -> None:
        """Until the lines queued so far are written (the listener marks each
        done), at most FLUSH_S: READY must follow what the start logged (a
        supervisor or test that reads the log at READY missed the stale
        socket's line), yet a stuck stderr must not hold the start."""
        deadline = time.monotonic() + FLUSH_S
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(1e-3)


def _log_off_the_loop() -> logging.handlers.QueueListener:
    """Log lines go through a queue to a thread that writes them: a write to
    stderr can block for seconds (a file on a disk whose journal waits for
    discards, a pipe nobody reads), and the event loop logs every save and
    load at debug level: seen freezing the loop 12-33 s on a busy host, with
    an engine's saves past their deadline. Lines are formatted where they
    are logged (QueueHandler.prepare), so they keep their order and time.
    Bounded: past LOG_BACKLOG lines waiting (stderr stuck for good) new lines
    are dropped, not kept."""
    root = logging.getLogger()
    handlers = root.handlers[:]
    q: queue.Queue[logging.LogRecord] = queue.Queue(LOG_BACKLOG)
    for h in handlers:
        root.removeHandler(h)
    root.addHandler(_DroppingQueueHandler(q))
    listener = logging.handlers.QueueListener(q, *handlers)
    listener.start()
    return listener


def _run(
    args: argparse.Namespace, config: ServerConfig, warnings: list[str]
) -> str | None:
    """Serve until stopped: None, or why the server could not start."""
    if args.peer_token is not None:
        warnings.append(
            "--peer-token is visible to every local user in `ps`; prefer "
            "$PEGAFLOW_PEER_TOKEN or --peer-token-file"
        )
    for line in warnings:
        logging.getLogger(__name__).warning("%s", line)
    from pegaflow.cache.pool_file import PoolFileError
    from pegaflow.gds import SsdError

    start_clock.mark("flags")
    from .assembly import serve  # grpc/numpy import after argument errors

    start_clock.mark("server imports")

    try:
        asyncio.run(serve(config))
    except (
        HugepagesUnavailable,
        PoolTooLarge,
        PoolFileError,
        SsdError,
        StartupError,
    ) as exc:
        return str(exc)
    except OSError as exc:  # not foreseen: at least one line, not a traceback
        return f"cannot start: {exc}"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
