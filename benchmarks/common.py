"""Shared bits of the benchmark scripts: a server subprocess and result output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO

from pegaflow.demo.spawn import spawn_server

ROOT = Path(__file__).resolve().parent.parent


def start_server(
    *args: str, stderr: IO[bytes] | None = None
) -> tuple[subprocess.Popen, str]:
    return spawn_server("--no-http", "--log-level", "warning", *args, stderr=stderr)


def metric_lines(http: str, timeout: float = 10) -> list[str]:
    """The sample lines of a server's /metrics (no comments)."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=timeout) as r:
        body = r.read().decode()
    return [line for line in body.splitlines() if line and not line.startswith("#")]


def metric_totals(http: str) -> dict[str, float]:
    """Each metric of /metrics summed over its labels, by name."""
    out: dict[str, float] = {}
    for line in metric_lines(http):
        name, value = line.rsplit(" ", 1)
        name = name.split("{")[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def machine() -> dict[str, object]:
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_json(name: str, payload: dict[str, object], path: str | None) -> Path:
    """Write the results atomically (a temp file beside it, then a rename): a
    run cut short between two writes leaves the previous complete file."""
    out = Path(path) if path else ROOT / "benchmarks" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    os.replace(tmp, out)
    return out


def table(rows: list[dict[str, object]], cols: list[str]) -> str:
    width = {c: max(len(c), *(len(f"{r[c]}") for r in rows)) for c in cols}
    lines = [" | ".join(c.rjust(width[c]) for c in cols)]
    lines.append("-|-".join("-" * width[c] for c in cols))
    lines += [" | ".join(f"{r[c]}".rjust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)
