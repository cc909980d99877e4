"""Every numeric setting is finite and in a sane range, checked once in the
config dataclasses; the CLI names the flag, not the field."""

from __future__ import annotations

import math

import pytest

from pegaflow.common.settings import (
    CudaConfig,
    EngineConfig,
    HitRateConfig,
    PoolConfig,
    parse_devices,
    parse_duration,
)
from pegaflow.server.cli import build_parser, config_from_args
from pegaflow.server.server_config import ServerConfig

BAD_SECONDS = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e9]


@pytest.mark.parametrize("value", BAD_SECONDS)
def test_lease_ttl_must_be_finite_and_bounded(value: float) -> None:
    """Scenario: --lease-ttl nan (or inf) was accepted; `now - ttl` is then nan
    or -inf, leases never expire and one unconsumed query pins its blocks."""
    with pytest.raises(ValueError, match="lease_ttl_s"):
        EngineConfig(lease_ttl_s=value)


@pytest.mark.parametrize("value", BAD_SECONDS)
def test_other_durations_must_be_finite(value: float) -> None:
    with pytest.raises(ValueError, match="event_timeout_s"):
        CudaConfig(event_timeout_s=value)
    with pytest.raises(ValueError, match="lease_sweep_interval_s"):
        EngineConfig(lease_sweep_interval_s=value)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda v: EngineConfig(copy_threads=v), "copy_threads"),
        (lambda v: PoolConfig(prefault_threads=v), "prefault_threads"),
        (lambda v: CudaConfig(max_ctas=v), "max_ctas"),
        (lambda v: HitRateConfig(bucket_bits=v), "metric_hll_bucket_bits"),
    ],
)
@pytest.mark.parametrize("value", [0, -1, 10**6, 2.5, True])
def test_counts_are_integers_in_range(make, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        make(value)


def test_sizes_and_windows() -> None:
    with pytest.raises(ValueError, match="pool_size"):
        PoolConfig(size_bytes=1 << 60)
    with pytest.raises(ValueError, match="pool_size"):
        PoolConfig(size_bytes=1 << 10)
    with pytest.raises(ValueError, match="max_message_bytes"):
        ServerConfig(max_message_bytes=1 << 40)
    for window in (math.inf, math.nan, 0.5, 400 * 86400.0):
        with pytest.raises(ValueError, match="metric_hll_windows"):
            HitRateConfig(windows_s=(window,))
    for text in ("infs", "nanm", "infh"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(text)


def test_ssd_numbers(tmp_path) -> None:
    from pegaflow.gds import SsdConfig

    path = (str(tmp_path / "a"),)
    SsdConfig(path, 64 << 20, sync_interval_s=0.0)  # 0: sync every write, fine
    for kwargs, field in [
        ({"queue_blocks": 0}, "ssd_queue_blocks"),
        ({"queue_blocks": 1 << 40}, "ssd_queue_blocks"),
        ({"write_threads": 1000}, "ssd_write_threads"),
        ({"read_threads": 0}, "ssd_read_threads"),
        ({"ghost_keys": 0}, "ssd_ghost_keys"),
        ({"journal_slack": 1}, "ssd_journal_slack"),
        ({"sync_interval_s": math.nan}, "ssd_sync_interval_s"),
        ({"sync_interval_s": math.inf}, "ssd_sync_interval_s"),
    ]:
        with pytest.raises(ValueError, match=field):
            SsdConfig(path, 64 << 20, **kwargs)
    with pytest.raises(ValueError, match="ssd_cache_capacity"):
        SsdConfig(path, 1 << 63)


def test_defaults_pass() -> None:
    ServerConfig()
    config_from_args(build_parser().parse_args([]))


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--lease-ttl", "nan"], "--lease-ttl"),
        (["--lease-ttl", "inf"], "--lease-ttl"),
        (["--copy-threads", "0"], "--copy-threads"),
        (["--prefault-threads", "100000"], "--prefault-threads"),
        (["--copy-ctas", "0"], "--copy-ctas"),
        (["--cuda-event-timeout", "nan"], "--cuda-event-timeout"),
        (["--metric-hll-bucket-bits", "30"], "--metric-hll-bucket-bits"),
        (["--pool-size", "2000tb"], "--pool-size"),
    ],
)
def test_cli_names_the_flag(argv: list[str], flag: str) -> None:
    from pegaflow.server.cli import flag_message

    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError) as info:
        config_from_args(args)
    assert flag_message(info.value).startswith(f"argument {flag}: ")


def test_a_gpu_named_twice_is_refused() -> None:
    """`--devices 0,0` would build two copy states for one GPU (the second
    one winning); the flag's parser says so instead."""
    with pytest.raises(ValueError, match="names a GPU twice"):
        parse_devices("0,1,0")
    assert parse_devices("1,0").devices == (1, 0)
