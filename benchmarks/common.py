"""Shared bits of the benchmark scripts: a server subprocess and result output."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pegaflow.cli",
            "--addr",
            "127.0.0.1:0",
            "--no-http",
            "--log-level",
            "warning",
            *args,
        ],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.split()[1].split("=", 1)[1]


def machine() -> dict[str, object]:
    import os

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_json(name: str, payload: dict[str, object], path: str | None) -> Path:
    out = Path(path) if path else ROOT / "benchmarks" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return out


def table(rows: list[dict[str, object]], cols: list[str]) -> str:
    width = {c: max(len(c), *(len(f"{r[c]}") for r in rows)) for c in cols}
    lines = [" | ".join(c.rjust(width[c]) for c in cols)]
    lines.append("-|-".join("-" * width[c] for c in cols))
    lines += [" | ".join(f"{r[c]}".rjust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)
