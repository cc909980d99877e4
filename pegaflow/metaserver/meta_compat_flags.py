"""The original PegaFlow `pegaflow-metaserver`'s flags that have no flag of ours.

As pegaflow.server.compat_flags does for the server: a command line copied from the
original's docs keeps working. Each flag here is mapped to our settings
(--max-capacity-mb), accepted and ignored with one WARNING line saying why
(`IGNORED`), or refused with a message (`REFUSED`) where starting without the
behaviour it asks for would mislead the operator. The flags we share with the
original (--addr, --http-addr, --log-level, --node-stale-secs, --ttl-minutes)
live in pegaflow.metaserver.meta_cli itself.

Sources: the original's `pegaflow-metaserver/src/lib.rs` `Cli` (0.23-0.25)
and its README (--max-capacity-mb, from before --node-stale-secs existed).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping

# Measured RSS per entry with 32-byte hashes (docs/metaserver.md: ~260 MiB per
# million entries), so --max-capacity-mb bounds memory as the original's did.
BYTES_PER_ENTRY = 272
MIN_ENTRIES = 16

# flag -> (argparse type, or None for a switch; why it is ignored here)
IGNORED: dict[str, tuple[Callable[[str], object] | None, str]] = {
    "--sweep-interval-secs": (
        int,
        "stale nodes and expired entries are swept every "
        "min(--node-stale-secs/4, TTL/8, 5 s) here",
    ),
    "--min-reclaimable-owner-count": (
        int,
        "blocks are never marked reclaimable here; every node evicts by its own policy",
    ),
    "--backup-target-delay-secs": (
        int,
        "it only tunes decode-node backup, which this metaserver does not plan",
    ),
    "--backup-inflight-ttl-secs": (
        int,
        "it only tunes decode-node backup, which this metaserver does not plan",
    ),
    "--backup-max-bytes-per-sec": (
        int,
        "it only tunes decode-node backup, which this metaserver does not plan",
    ),
}
# The original reads these variables as the flags of the same meaning.
ENV_OF = {
    "--min-reclaimable-owner-count": "PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT",
    "--enable-decode-backup": "PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP",
}
# flag -> why starting without its behaviour would mislead
REFUSED = {
    "--enable-decode-backup": (
        "decode-node backup is not implemented here: idle nodes would hold no "
        "backup copies, so blocks a prefill node evicts would be lost, not "
        "recalled; start without it (the --backup-* tuning is then ignored)"
    ),
}
_TRUE = {"1", "true", "yes", "on", "y", "t"}


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The original's flags without a flag of ours; the ignored and refused
    ones are hidden from --help's list (docs/metaserver.md names each)."""
    g = p.add_argument_group(
        "flags of the original PegaFlow metaserver",
        "accepted so its command lines start unchanged; see docs/migration.md",
    )
    g.add_argument(
        "--max-capacity-mb",
        type=int,
        default=None,
        help=f"memory bound in MiB: sets --max-entries to MB*2**20/"
        f"{BYTES_PER_ENTRY} (the measured bytes per entry) unless that is given",
    )
    for flag, (kind, _why) in IGNORED.items():
        g.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    for flag in REFUSED:
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)


def refused(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The error message for the first refused flag or variable, if any."""
    for flag, why in REFUSED.items():
        env = ENV_OF.get(flag)
        if getattr(args, dest(flag)):
            return f"argument {flag}: {why}"
        if env and environ.get(env, "").strip().lower() in _TRUE:
            return f"${env}: {why}"
    return None


def ignored_warnings(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> list[str]:
    """One line per ignored flag (or the variable standing for it)."""
    lines = []
    for flag, (_kind, why) in IGNORED.items():
        value = getattr(args, dest(flag))
        env = ENV_OF.get(flag)
        if value is not None:
            lines.append(f"{flag} {value} is accepted and ignored: {why}")
        elif env and environ.get(env):
            lines.append(f"${env} is accepted and ignored: {why}")
    return lines


def max_entries(args: argparse.Namespace, default: int) -> int:
    """--max-entries when given, else --max-capacity-mb mapped, else default."""
    if args.max_entries is not None:
        return args.max_entries
    if args.max_capacity_mb is not None:
        if args.max_capacity_mb < 1:
            raise ValueError("max_capacity_mb: must be >= 1")
        return max(args.max_capacity_mb * (1 << 20) // BYTES_PER_ENTRY, MIN_ENTRIES)
    return default
