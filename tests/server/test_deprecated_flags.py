"""Flags of ours that set measured constants (issue 28): `--copy-crossovers`,
`--copy-contention-ratio` and `--copy-wait` are accepted for a release, change
nothing, and each says so in one WARNING line; --help no longer lists them.
The constants are pegaflow/copiers/measured.py's; `--copy-path` stays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pegaflow.server.cli import build_parser, config_from_args
from pegaflow.server.compat_flags import DEPRECATED, ignored_warnings
from tests.procs import ROOT, _env, start_server

# Values an old command line may carry, the forms argparse takes included.
OLD_FLAGS = [
    "--copy-crossovers",
    "save:1-128:65536,load:7",
    "--copy-contention-ratio",
    "0.5",
    "--copy-wait=thread",
]


def test_deprecated_flags_change_nothing() -> None:
    """The same settings as without them, one warning line each."""
    parser = build_parser()
    args = parser.parse_args(OLD_FLAGS)
    assert config_from_args(args) == config_from_args(parser.parse_args([]))
    lines = ignored_warnings(args)
    assert len(lines) == len(DEPRECATED) == 3
    for flag in DEPRECATED:
        [line] = [line for line in lines if line.startswith(f"{flag} ")]
        assert "is deprecated and ignored: " in line and "measured.py" in line
    assert sum("--copy-path" in line for line in lines) == 2  # what replaces them
    assert "nothing replaces it" in next(x for x in lines if "--copy-wait" in x)
    # values the flags once refused are ignored as well
    odd = parser.parse_args(["--copy-wait", "spin", "--copy-contention-ratio", "2"])
    assert config_from_args(odd) == config_from_args(parser.parse_args([]))


def test_server_starts_with_them_and_warns_once_each(tmp_path: Path) -> None:
    """Scenario: a command line from before the flags went still starts the
    server, whose log names each flag in exactly one WARNING line."""
    server = start_server(tmp_path, "--pool-size", "16mb", *OLD_FLAGS)
    try:
        status, _ = server.get("/health")
        assert status == 200
    finally:
        assert server.stop() == 0
    log = server.log.read_text()
    warned = [line for line in log.splitlines() if "is deprecated and ignored" in line]
    assert len(warned) == 3 and all(" WARNING " in line for line in warned), log
    for flag in DEPRECATED:
        assert sum(f" {flag} " in line for line in warned) == 1, (flag, log)


def test_help_of_the_server_command() -> None:
    """`pegaflow-server --help` (python -m pegaflow.cli): the flags are gone."""
    proc = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "--help"],
        capture_output=True,
        env=_env(),
        cwd=ROOT,
        timeout=60,
    )
    out = proc.stdout.decode()
    assert proc.returncode == 0 and "--copy-path" in out
    assert not any(flag in out for flag in DEPRECATED)
