"""pegaflow-server's flags of the L2 remote tier (docs/multinode.md), and the
RemoteConfig they make; the CLI (pegaflow.cli) adds and reads them here."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegaflow.tiers.remote.remote_config import RemoteConfig


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cross-node sharing (the L2 remote tier)")
    g.add_argument(
        "--metaserver-addr",
        default=None,
        metavar="[http://]HOST:PORT",
        help="pegaflow-metaserver to advertise to and ask on a local miss; turns "
        "the remote tier on (default: off). --addr must then be this node's "
        "routable address",
    )
    g.add_argument(
        "--nics",
        action="extend",
        nargs="+",
        default=None,
        metavar="DEV",
        help="RDMA devices for one-sided reads (mlx5_0 mlx5_1, or comma-"
        "separated); each must have an active port",
    )
    g.add_argument(
        "--remote-transport",
        choices=["rdma", "tcp"],
        default=None,
        help="how peers' blocks are read (default: rdma with --nics, else tcp)",
    )
    g.add_argument(
        "--enable-rdma",
        action="store_true",
        help="the original's spelling of --remote-transport rdma",
    )
    g.add_argument(
        "--node-id",
        default="",
        help="this node's stable name at the metaserver (default: --addr)",
    )
    token = g.add_mutually_exclusive_group()
    token.add_argument(
        "--peer-token-env",
        metavar="NAME",
        default=None,
        help="the cluster's shared token is in environment variable NAME "
        "(default: $PEGAFLOW_PEER_TOKEN when set)",
    )
    token.add_argument(
        "--peer-token-file",
        metavar="PATH",
        default=None,
        help="the cluster's shared token is in this file (mode 0600)",
    )
    token.add_argument(
        "--peer-token",
        default=None,
        help="the token itself (visible in ps: prefer --peer-token-env/-file)",
    )
    g.add_argument(
        "--remote-fetch-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a peer fetch taking longer becomes a miss (default: %(default)s)",
    )
    g.add_argument(
        "--remote-quarantine",
        type=float,
        default=None,
        metavar="SECONDS",
        help="local slots of a peer read that failed while bytes may still land "
        "stay out of use this long (default: 4x the transfer engine's timeouts, "
        "at least 60)",
    )
    g.add_argument(
        "--remote-query-timeout",
        type=float,
        default=0.05,
        metavar="SECONDS",
        help="how long a query waits for the metaserver before it answers "
        "'loading' (the answer and the fetch go on in the background; the "
        "engine asks again) (default: %(default)s)",
    )
    g.add_argument(
        "--metaserver-queue-depth",
        type=int,
        default=1 << 20,
        metavar="HASHES",
        help="block hashes waiting to be advertised; beyond it they are dropped "
        "and counted (default: %(default)s)",
    )
    g.add_argument(
        "--remote-allow-loopback",
        action="store_true",
        help="let --addr be loopback: peers on this one host only (trying it out)",
    )


def remote_config(args: argparse.Namespace) -> RemoteConfig | None:
    nics = tuple(n for part in args.nics or () for n in part.split(",") if n)
    if args.metaserver_addr is None:
        if nics or args.enable_rdma or args.remote_transport:
            raise ValueError("remote_transport: --nics/--enable-rdma/--remote-"
                             "transport need --metaserver-addr")  # fmt: skip
        return None
    from pegaflow.common import peer_auth
    from pegaflow.tiers.remote.remote_config import RemoteConfig

    protocol = args.remote_transport or ("rdma" if nics or args.enable_rdma else "tcp")
    token = peer_auth.read_token(
        args.peer_token, args.peer_token_env, args.peer_token_file
    )
    return RemoteConfig(
        metaserver_addr=args.metaserver_addr,
        protocol=protocol,
        nics=nics,
        token=token,
        node_id=args.node_id,
        query_timeout_s=args.remote_query_timeout,
        fetch_timeout_s=args.remote_fetch_timeout,
        quarantine_s=args.remote_quarantine,
        max_advertise_queue=args.metaserver_queue_depth,
        allow_loopback=args.remote_allow_loopback,
    )
