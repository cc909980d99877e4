"""The original PegaFlow `pegaflow-metaserver`'s command lines start this one.

Flags and defaults are those of the original's `Cli` (pegaflow-metaserver
src/lib.rs, 0.23-0.25, the decode-backup flags included) and its README's
--max-capacity-mb. Each is honoured, mapped, ignored with one WARNING line, or
(--enable-decode-backup) refused with the reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pegaflow import __version__
from pegaflow.metaserver import meta_compat_flags as original
from pegaflow.metaserver.meta_cli import build_parser, config_from_args
from tests.metaserver.conftest import start_metaserver
from tests.procs import ROOT, _env

# The original's flags with values from its docs (sizes kept small).
SHARED = [
    ("--addr", "127.0.0.1:0"),
    ("--http-addr", "127.0.0.1:0"),
    ("--log-level", "warn"),
    ("--node-stale-secs", "120"),
    ("--ttl-minutes", "180"),
]
IGNORED = [
    ("--sweep-interval-secs", "600"),
    ("--min-reclaimable-owner-count", "2"),
    ("--backup-target-delay-secs", "180"),
    ("--backup-inflight-ttl-secs", "180"),
    ("--backup-max-bytes-per-sec", "2147483648"),
]
MAPPED = [("--max-capacity-mb", "64")]


def _argv(flags: list[tuple[str, ...]]) -> list[str]:
    return [part for flag in flags for part in flag]


def test_every_original_flag_parses_and_maps() -> None:
    """Scenario: the original's whole command line (the refused switch aside)
    parses; trace/warn levels map; --max-capacity-mb bounds entries by the
    measured bytes per entry unless --max-entries is given."""
    every = [*SHARED, *IGNORED, *MAPPED, ("--log-level", "trace")]
    args = build_parser().parse_args(_argv(every))
    config = config_from_args(args)
    assert config.log_level == "debug"
    assert config.node_stale_s == 120 and config.ttl_s == 180 * 60
    assert config.max_entries == 64 * 2**20 // original.BYTES_PER_ENTRY
    explicit = build_parser().parse_args(
        ["--max-capacity-mb", "64", "--max-entries", "99"]
    )
    assert config_from_args(explicit).max_entries == 99
    assert len(original.ignored_warnings(args, environ={})) == len(IGNORED)


def test_original_command_line_starts_and_names_each_ignored_flag(
    tmp_path: Path,
) -> None:
    """Scenario: a user starts this metaserver with the original's flags and
    the original's variable for --min-reclaimable-owner-count: it comes up
    (READY) and logs one WARNING per ignored flag, saying why."""
    env = {original.ENV_OF["--min-reclaimable-owner-count"]: "3"}
    flags = [f for f in SHARED if f[0] not in ("--addr", "--http-addr")]
    ignored = [f for f in IGNORED if f[0] != "--min-reclaimable-owner-count"]
    meta = start_metaserver(tmp_path, *_argv([*flags, *ignored, *MAPPED]), env=env)
    try:
        status, _ = meta.get("/health")
        assert status == 200
        log = meta.log.read_text()
        for flag, value in ignored:
            assert (
                f"WARNING pegaflow.metaserver.meta_cli: {flag} {value} is accepted "
                "and ignored: " in log
            )
        assert "$PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT is accepted" in log
        want = 64 * 2**20 // original.BYTES_PER_ENTRY
        assert meta.metric("pegaflow_meta_max_entries") == want
    finally:
        meta.stop()


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pegaflow.metaserver", "--addr", "127.0.0.1:0", *args],
        env={**_env(), **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_decode_backup_refused_with_the_reason() -> None:
    """--enable-decode-backup (or its variable set true) asks for backups this
    metaserver never plans: the start stops, saying so, rather than leaving
    idle nodes empty under a WARNING. The variable set false is fine."""
    for res in (
        _run("--enable-decode-backup"),
        _run(env={"PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP": "true"}),
    ):
        assert res.returncode == 2, res.stdout + res.stderr
        assert "decode-node backup is not implemented here" in res.stderr
    args = build_parser().parse_args([])
    off = {"PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP": "false"}
    assert original.refused(args, environ=off) is None


def test_version_and_help() -> None:
    """-V prints the version; --help shows the mapped flag and says the
    original's HTTP default differs from ours."""
    assert _run("-V").stdout.strip() == __version__
    text = _run("--help").stdout
    assert "--max-capacity-mb" in text and "0.0.0.0:9092" in text
