"""The short table of benchmarks/device/device_session_issue12c.sh, from the JSON of
its two transfer.py runs in $OUT (transfer-auto.json, transfer-kernel.json):
ratios to the pinned ceiling per N and ids, auto next to kernel-only, then the
1-block latencies of both and the goals of issue 12.

    OUT=/tmp/out python3 benchmarks/issue12c_summary.py
    OUT=/tmp/out TAGS=a,b python3 benchmarks/issue12c_summary.py   # other runs
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

from benchmarks.common import table  # noqa: E402

RUNS = ("auto", "kernel")
LATENCIES = (  # key in transfer.py's extra, label, issue 12's goal in ms
    ("lat_save_event_p50_ms", "save, event-ordered P50", 0.4),
    ("lat_save_synced_p50_ms", "save, engine-synced P50", None),
    ("lat_load_p50_ms", "load P50", 0.3),
    ("lat_save_event_copy_mean_ms", "save (event) server copy mean", None),
    ("lat_save_synced_copy_mean_ms", "save (synced) server copy mean", None),
    ("lat_load_copy_mean_ms", "load server copy mean", None),
    ("lat_save_synced_server_rpc_mean_ms", "save (synced) server RPC mean", None),
    ("lat_load_server_rpc_mean_ms", "load server RPC mean", None),
)


def load(out: Path, tag: str) -> dict | None:
    path = out / f"transfer-{tag}.json"
    return json.loads(path.read_text()) if path.exists() else None


def ratio_rows(runs: dict[str, dict | None]) -> list[dict[str, object]]:
    """One row per (N, ids): each run's ratios, copy GB/s and RPC ms."""
    by: dict[tuple, dict[str, object]] = {}
    for tag, run in runs.items():
        for r in (run or {}).get("rows", []):
            key = (r["N"], r["ids"])
            row = by.setdefault(key, {"N": r["N"], "ids": r["ids"]})
            row[f"{tag} save"] = r["save_ratio"]
            row[f"{tag} load"] = r["load_ratio"]
            row[f"{tag} copy GB/s s/l"] = f"{r['save_copy_GBps']}/{r['load_copy_GBps']}"
            row[f"{tag} rpc ms s/l"] = f"{r['save_rpc_ms']}/{r['load_rpc_ms']}"
            row.setdefault("ok", True)
            row["ok"] = row["ok"] and r["bytes_ok"]
    return [by[k] for k in sorted(by)]


def summary(out: Path, tags: tuple[str, ...] = RUNS) -> str:
    runs = {tag: load(out, tag) for tag in tags}
    lines = []
    rows = ratio_rows(runs)
    if rows:
        cols = ["N", "ids"]
        for tag in tags:
            cols += [f"{tag} save", f"{tag} load", f"{tag} copy GB/s s/l"]
            cols.append(f"{tag} rpc ms s/l")
        cols.append("ok")
        for r in rows:
            for c in cols:
                r.setdefault(c, "-")
        lines.append("ratio to the pinned ceiling, end to end (Llama-3.1-8B pages)")
        lines.append(table(rows, cols))
        bad = [r for r in rows if r["ok"] is not True]
        lines.append("bytes_ok: all" if not bad else f"bytes_ok FAILED: {bad}")
    lat = []
    for key, label, goal in LATENCIES:
        row: dict[str, object] = {"1 block x 32 layers, ms": label}
        for tag in tags:
            row[tag] = ((runs[tag] or {}).get("extra") or {}).get(key, "-")
        row["goal"] = "-" if goal is None else f"<= {goal}"
        lat.append(row)
    lines.append("")
    lines.append(table(lat, ["1 block x 32 layers, ms", *tags, "goal"]))
    for tag in tags:
        extra = (runs[tag] or {}).get("extra") or {}
        if "both_total_GBps" in extra:
            lines.append(
                f"{tag}: save + load at once, N={extra['both_N']}: "
                f"{extra['both_total_GBps']} GB/s"
            )
    missing = [tag for tag in tags if runs[tag] is None]
    if missing:
        lines.append(f"missing runs: {missing} (see their logs in $OUT)")
    return "\n".join(lines)


def main() -> int:
    tags = tuple(os.environ.get("TAGS", ",".join(RUNS)).split(","))
    print(summary(Path(os.environ.get("OUT", "/tmp/out")), tags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
