"""`pegaflow-server status`: one screen about a running server, read from its
HTTP /stats document (pegaflow.server.report): pool, tiers, per-namespace hit
rate beside its ceiling, and the top miss causes.

Standard library only, so it starts fast and runs anywhere the server's HTTP
port is reachable.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import urllib.error
import urllib.request

Stats = dict[str, object]


def fetch(http_addr: str, timeout_s: float = 5.0) -> Stats:
    with urllib.request.urlopen(f"http://{http_addr}/stats", timeout=timeout_s) as r:
        stats = json.loads(r.read())
    if not isinstance(stats, dict) or "pool" not in stats:
        raise ValueError("not a pegaflow /stats document")
    return stats


def diagnose(http_addr: str, exc: BaseException, timeout_s: float) -> str:
    """One line: what `http_addr` turned out to be, and which flag to pass."""
    fix = "pass the server's --http-addr (its /health and /metrics address)"
    reason = getattr(exc, "reason", exc)  # URLError wraps the socket's error
    if isinstance(exc, urllib.error.HTTPError):
        return (
            f"{http_addr} answers HTTP but has no pegaflow /stats (HTTP "
            f"{exc.code}): not a pegaflow-server's HTTP port? {fix}"
        )
    if isinstance(reason, ConnectionRefusedError):
        return f"nothing listens at {http_addr} (connection refused); {fix}"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer from {http_addr} within {timeout_s:g} s; {fix}"
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve {http_addr} ({reason.strerror}); {fix}"
    if isinstance(reason, (http.client.HTTPException, ConnectionResetError)):
        return (
            f"{http_addr} answered, but not with HTTP/1.1 (is it the gRPC port, "
            f"--addr?); {fix}"
        )
    if isinstance(exc, ValueError):  # JSON, or a malformed address
        return f"{http_addr} did not answer with pegaflow /stats JSON; {fix}"
    text = getattr(reason, "strerror", None) or reason
    return f"cannot read http://{http_addr}/stats ({text}); {fix}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _uptime(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d {h}h {m}m" if d else f"{h}h {m}m {s}s" if h else f"{m}m {s}s"


def _header(stats: Stats, http_addr: str) -> list[str]:
    pool, policy, hll = stats["pool"], stats["policy"], stats["hll"]
    cap = pool["capacity_bytes"]
    used = pool["used_bytes"] / cap if cap else 0.0
    rejected = ", ".join(f"{k} {v:,}" for k, v in policy["rejected"].items())
    lines = [
        f"pegaflow-server at {http_addr} (pid {stats['pid']}, "
        f"up {_uptime(stats['uptime_s'])})",
        "",
        f"pool    {_bytes(pool['used_bytes'])} of {_bytes(cap)} used "
        f"({_pct(used).strip()}), {pool['resident_blocks']:,} blocks resident, "
        f"{pool['leases']} leases, {pool['instances']} instances",
        f"policy  admission {policy['admission']}, "
        f"{policy['evictions']:,} evictions, rejected: {rejected}",
    ]
    for i, (tier, t) in enumerate(stats["tiers"].items()):
        state = "on " if t["enabled"] else "off"
        peers = f" ({t['peers']} peers)" if "peers" in t else ""
        label = "tiers   " if i == 0 else " " * 8
        lines.append(f"{label}{tier:<7}{state}{peers:<12} {t['hit_blocks']:,} hits")
        if tier == "remote" and t["enabled"]:
            lines.append(_remote(t))
    lines.append(
        f"ceiling HyperLogLog over {', '.join(hll['windows'])}: 2**"
        f"{hll['bucket_bits']} registers x {hll['sub_windows']} sub-windows, "
        f"{_bytes(hll['memory_bytes'])}"
    )
    return lines


def _remote(t: Stats) -> str:
    failed = ", ".join(f"{k} {v:,}" for k, v in t["failed_blocks"].items() if v)
    joined = "joined" if t["joined"] else "NOT joined"
    return (
        f"{' ' * 15}{joined} {t['metaserver']}; fetched "
        f"{_bytes(t['fetched_bytes'])} in {t['fetches']:,} fetches, "
        f"{t['fetch_ms_mean']:.1f} ms mean; {t['pins_held']} pins held; "
        f"failed: {failed or 'none'}"
    )


def _namespace(ns: Stats) -> list[str]:
    lines = []
    for i, (window, w) in enumerate(ns["windows"].items()):
        name = ns["tag"] if i == 0 else ""
        gap = 100 * (w["ceiling"] - w["hit_rate"])
        lines.append(
            f"{name:<20} {window:>6} {w['requests']:>12,} {_pct(w['hit_rate']):>9}"
            f" {_pct(w['ceiling']):>9} {gap:>7.1f}"
        )
    misses = ns["misses"]
    total = sum(misses.values())
    if total:
        top = sorted(misses.items(), key=lambda kv: -kv[1])
        causes = "  ".join(f"{c} {_pct(n / total).strip()}" for c, n in top if n)
        resident = ns["resident_misses"] / total
        lines.append(
            f"{'':<20} misses since start: {total:,} blocks: {causes}"
            f"  (resident behind a miss: {_pct(resident).strip()})"
        )
    return lines


def render(stats: Stats, http_addr: str) -> str:
    lines = _header(stats, http_addr)
    lines += [
        "",
        f"{'namespace tag':<20} {'window':>6} {'blocks':>12} {'hit rate':>9}"
        f" {'ceiling':>9} {'gap pt':>7}",
    ]
    namespaces = stats["namespaces"]
    if not namespaces:
        lines.append("(no queries yet)")
    for ns in namespaces:
        lines += _namespace(ns)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pegaflow-server status",
        description="Pool, tiers, hit rate vs ceiling and miss causes of a "
        "running pegaflow-server, from its HTTP endpoint.",
    )
    p.add_argument(
        "--http-addr",
        default="127.0.0.1:9091",
        help="the server's --http-addr (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the raw /stats JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default: 5)")
    args = p.parse_args(argv)
    if not 0 < args.timeout <= 3600:  # NaN fails this too
        p.error(f"argument --timeout: {args.timeout!r}, need seconds in (0, 3600]")
    try:
        stats = fetch(args.http_addr, args.timeout)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        # URLError and HTTPError are OSErrors; a non-HTTP peer (the gRPC port)
        # raises http.client's BadStatusLine or RemoteDisconnected.
        message = diagnose(args.http_addr, exc, args.timeout)
        print(f"pegaflow-server status: {message}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else render(stats, args.http_addr))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
