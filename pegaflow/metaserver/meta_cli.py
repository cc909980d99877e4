"""`pegaflow-metaserver`: flags -> MetaConfig -> serve."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

from pegaflow import __version__
from pegaflow.common import peer_auth
from pegaflow.common.settings import addr_arg, log_level, parse_addr

from . import meta_compat_flags as original
from .meta_config import MAX_NODES, MetaConfig

DEFAULT_MAX_ENTRIES = 4_000_000

# MetaConfig field -> the flag that sets it, for error messages.
FLAG_OF = {
    "node_stale_s": "--node-stale-secs",
    "ttl_s": "--ttl-minutes",
    "max_entries": "--max-entries/--max-capacity-mb",
    "max_nodes": "--max-nodes",
    "max_capacity_mb": "--max-capacity-mb",
    "token": "the peer token",
    "peer_token": "--peer-token",
    "peer_token_env": "--peer-token-env",
    "peer_token_var": "$" + peer_auth.ENV_VAR,
    "peer_token_file": "--peer-token-file",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pegaflow-metaserver",
        description="Which node holds which KV block, for cross-node sharing "
        "between pegaflow-servers (soft state: nodes re-advertise after a restart).",
    )
    p.add_argument(
        "--addr", type=addr_arg, default="127.0.0.1:50056", help="gRPC listen address"
    )
    p.add_argument(
        "--http-addr",
        type=addr_arg,
        default="127.0.0.1:9092",
        help="/health and /metrics (default %(default)s; the original's is "
        "0.0.0.0:9092: give that to serve other hosts)",
    )
    p.add_argument("--no-http", action="store_true", help="serve no HTTP endpoint")
    p.add_argument(
        "--node-stale-secs",
        type=float,
        default=30.0,
        help="drop a node (and its entries) not heard from for this long; nodes "
        "heartbeat every third of it (default %(default)s)",
    )
    p.add_argument(
        "--ttl-minutes",
        type=float,
        default=60.0,
        help="drop an entry not re-inserted for this long (default %(default)s)",
    )
    p.add_argument(
        "--max-entries",
        type=int,
        default=None,
        help="most (block, owner) entries held; the oldest are evicted beyond it "
        f"(default {DEFAULT_MAX_ENTRIES}, ~1 GiB)",
    )
    p.add_argument(
        "--max-nodes",
        type=int,
        default=MAX_NODES,
        help="most nodes joined at once; a join beyond it is refused "
        "(RESOURCE_EXHAUSTED naming this flag; default %(default)s)",
    )
    token = p.add_mutually_exclusive_group()
    token.add_argument(
        "--peer-token",
        metavar="TOKEN",
        help="require this shared token on every RPC (it shows in `ps`: prefer "
        f"${peer_auth.ENV_VAR}, used when none of these three flags is given)",
    )
    token.add_argument(
        "--peer-token-env",
        metavar="NAME",
        help="require the shared token in environment variable NAME on every RPC",
    )
    token.add_argument(
        "--peer-token-file",
        metavar="PATH",
        help="require the shared token in this file (mode 0600) on every RPC",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=log_level,
        choices=["debug", "info", "warning", "error"],
        help="also the original's trace (logged as debug) and warn",
    )
    p.add_argument("-V", "--version", action="version", version=__version__)
    original.add_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> MetaConfig:
    return MetaConfig(
        addr=args.addr,
        http_addr=None if args.no_http else args.http_addr,
        node_stale_s=args.node_stale_secs,
        ttl_s=args.ttl_minutes * 60.0,
        max_entries=original.max_entries(args, DEFAULT_MAX_ENTRIES),
        max_nodes=args.max_nodes,
        log_level=args.log_level,
        token=peer_auth.read_token(
            args.peer_token, args.peer_token_env, args.peer_token_file
        ),
    )


def _flag_message(exc: ValueError) -> str:
    field, sep, rest = str(exc).partition(": ")
    flag = FLAG_OF.get(field)
    if not (sep and flag):
        return str(exc)
    return f"argument {flag}: {rest}" if flag.startswith("--") else f"{flag}: {rest}"


def _routable(addr: str) -> bool:
    host, _ = parse_addr(addr)
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return host != "localhost"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (why := original.refused(args)) is not None:
        parser.error(why)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(_flag_message(exc))
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger(__name__)
    for line in original.ignored_warnings(args):
        log.warning("%s", line)
    if args.peer_token is not None:
        log.warning(
            "--peer-token is visible to every local user in `ps`; prefer $%s",
            peer_auth.ENV_VAR,
        )
    if config.token is None and _routable(config.addr):
        log.warning(
            "--addr %s is reachable from other hosts and no peer token is set: "
            "anyone who reaches it can advertise and query blocks",
            config.addr,
        )
    from pegaflow.daemon.startup import StartupError

    from .meta_server import serve  # grpc imports after arg errors

    try:
        serve(config)
    except StartupError as exc:
        print(f"pegaflow-metaserver: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pegaflow-metaserver: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
