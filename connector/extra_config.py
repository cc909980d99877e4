"""The connector's options: environment + `kv_connector_extra_config`, read once.

Pure Python on purpose (no vLLM, no torch): `parse_config` is the one place that
knows the option names, and every error names the key and what it accepts.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from pegaflow.client.busy_poll import GPU_ENGINE_BUSY_POLL_US, check_busy_poll_us
from pegaflow.common.deadlines import MAX_AHEAD_S

logger = logging.getLogger(__name__)

DEFAULT_HOST = "http://127.0.0.1"
DEFAULT_PORT = 50055
Mode = Literal["read_write", "save_only"]
Planner = Literal["auto", "off"]
# The original PegaFlow connector's keys that tune what is not here: accepted,
# and a WARNING says why when one is set to anything but its default.
ORIGINAL_IGNORED = {
    "pegaflow.transfer_backend": "the server picks its copy engine per instance",
    "pegaflow.wait_for_full_prefix": "it waits for cross-node (RDMA) fetches",
    "pegaflow.pd_tail_save": "partial tail blocks of P/D are not cached here",
    "pegaflow.pd_tail_load": "partial tail blocks of P/D are not cached here",
}


AUTO_BUSY_POLL = -1  # busy_poll_us: by the engine's device (resolved_poll)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated options; field names are the accepted extra-config keys
    (except `addr`, which comes from PEGAFLOW_HOST / PEGAFLOW_PORT)."""

    addr: str = f"127.0.0.1:{DEFAULT_PORT}"
    # Server instance name; default derives from vLLM's engine_id, so the
    # scheduler and its workers agree without talking to each other.
    instance_id: str = ""
    # Mixed into the namespace digest: bump it when bytes change in a way the
    # config cannot see (a new checkpoint under the same model path).
    namespace_salt: str = ""
    # Deadline of the worker's Register / Save / Load calls.
    timeout_s: float = 10.0
    # Deadline of the scheduler's prefix query: the scheduler waits on it.
    query_timeout_s: float = 1.0
    # Hits of at most this many tokens load synchronously, before the forward
    # (waiting per layer); longer ones load asynchronously between steps.
    sync_load_max_tokens: int = 0
    # After the server was unreachable: how long queries are skipped (misses)
    # and how often the worker tries to register again.
    retry_interval_s: float = 2.0
    # A query answer (and its lease) is reused for the same request for this
    # long; must stay below the server's --lease-ttl.
    lease_reuse_s: float = 5.0
    # Save blocks that fill up during decode, not only prompt blocks.
    save_decode: bool = True
    # save_only: never query or load (another connector owns reads; the
    # original's `pegaflow.mode`).
    mode: Mode = "read_write"
    # auto: load a hit only where loading beats recomputing it (the server's
    # tier rates against this engine's measured prefill rate; fetch_plan.py);
    # off: load every hit.
    fetch_planner: Planner = "auto"
    # Poll the server's socket for each reply this long (microseconds, with
    # the GIL released) before sleeping on it, for a core kept busy meanwhile
    # (pegaflow.client.busy_poll). 0: sleep at once. -1 (auto):
    # GPU_ENGINE_BUSY_POLL_US on a GPU engine, 0 on a CPU one (resolved_poll).
    busy_poll_us: int = AUTO_BUSY_POLL
    # A GPU worker's loads name one of its IPC events: the server answers as
    # the copy is queued and the worker polls its event (docs/architecture.md,
    # "Load"); a copy failing after that answer ends the worker's connection,
    # which its wait watches. 64-block loads ran 44.3 GB/s against 38.1
    # answered done on an H100 host (benchmarks/RESULTS.md, session 18).
    # A host (CPU) worker's loads always answer done.
    loads_in_flight: bool = True
    # Host (CPU) KV: back it with a sealed memfd the server maps, so its
    # copies are memcpy instead of process_vm_* (pegaflow.client.host_share).
    share_host_kv: bool = True
    # A file holding the tenant secret: the HMAC key of the namespace digest,
    # so nobody without it can compute the namespace (and read its blocks).
    # Engines that share blocks share the secret. PEGAFLOW_TENANT_SECRET is
    # the other way to give it; the file, when named, wins.
    tenant_secret_file: str = ""
    # The secret as read (from the file or the environment); kept out of
    # repr. As an extra-config key it is accepted with a warning: vLLM's
    # config shows in `ps` and in logs.
    tenant_secret: bytes = field(default=b"", repr=False)

    @property
    def poll_us(self) -> int:
        """busy_poll_us for a client: auto not resolved (no vLLM device): 0."""
        return max(self.busy_poll_us, 0)

    def __post_init__(self) -> None:
        # NaN passes every comparison below unnoticed, and an infinite deadline
        # or interval turns a bounded wait into a hang: finite values only.
        for name in _SECONDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(
                    f"kv_connector_extra_config.{name}: expected a finite number "
                    f"of seconds, got {value!r}"
                )
        for name in ("timeout_s", "query_timeout_s", "retry_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv_connector_extra_config.{name}: must be > 0")
        for name in ("timeout_s", "query_timeout_s"):
            # The server refuses deadlines further ahead than this (another
            # clock's, to it): every call would fail.
            if getattr(self, name) > MAX_AHEAD_S:
                raise ValueError(
                    f"kv_connector_extra_config.{name}: must be <= {MAX_AHEAD_S:.0f}"
                )
        if self.lease_reuse_s < 0:
            raise ValueError("kv_connector_extra_config.lease_reuse_s: must be >= 0")
        if self.mode not in ("read_write", "save_only"):
            raise ValueError(
                "kv_connector_extra_config.mode: read_write or save_only, got "
                f"{self.mode!r}"
            )
        if self.fetch_planner not in ("auto", "off"):
            raise ValueError(
                "kv_connector_extra_config.fetch_planner: auto or off, got "
                f"{self.fetch_planner!r}"
            )
        if self.busy_poll_us != AUTO_BUSY_POLL:
            check_busy_poll_us(
                self.busy_poll_us, "kv_connector_extra_config.busy_poll_us"
            )
        if self.sync_load_max_tokens < 0:
            raise ValueError(
                "kv_connector_extra_config.sync_load_max_tokens: must be >= 0"
            )


_KEYS = {f.name: f for f in fields(ConnectorConfig) if f.name != "addr"}
# The float options, all durations in seconds.
_SECONDS = tuple(f.name for f in fields(ConnectorConfig) if f.type == "float")


def server_addr(env: Mapping[str, str]) -> str:
    """gRPC target from PEGAFLOW_HOST (default http://127.0.0.1, a plain host
    or [v6] also accepted) and PEGAFLOW_PORT (default 50055)."""
    host = env.get("PEGAFLOW_HOST", DEFAULT_HOST).strip()
    if host.startswith("http://"):
        host = host[len("http://") :]
    elif "://" in host:
        raise ValueError(
            f"PEGAFLOW_HOST={host!r}: only http:// (plaintext gRPC) is supported"
        )
    host = host.rstrip("/")
    if not host or "/" in host:
        raise ValueError(f"PEGAFLOW_HOST={host!r}: expected a host name or address")
    port_text = env.get("PEGAFLOW_PORT", str(DEFAULT_PORT)).strip()
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"PEGAFLOW_PORT={port_text!r}: expected a port 1..65535")
    if ":" in host and not host.startswith("["):  # bare IPv6 address
        host = f"[{host}]"
    return f"{host}:{int(port_text)}"


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check one value against its field's type (from the default's type)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(
                f"kv_connector_extra_config.{key}: expected true/false, got {value!r}"
            )
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"kv_connector_extra_config.{key}: expected an integer, got {value!r}"
            )
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"kv_connector_extra_config.{key}: expected a number, got {value!r}"
            )
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            raise ValueError(
                f"kv_connector_extra_config.{key}: expected a finite number, "
                f"got {value!r}"
            ) from None
    if not isinstance(value, str):
        raise ValueError(
            f"kv_connector_extra_config.{key}: expected a string, got {value!r}"
        )
    return value


def _tenant_secret(extra: dict[str, Any], env: Mapping[str, str]) -> bytes:
    """The secret from (in this order) tenant_secret_file, tenant_secret or
    PEGAFLOW_TENANT_SECRET; b"" for none. Errors never repeat a secret."""
    path = extra.get("tenant_secret_file", "")
    inline = extra.pop("tenant_secret", None)
    if path and inline is not None:
        raise ValueError(
            "kv_connector_extra_config: give tenant_secret_file or tenant_secret, "
            "not both"
        )
    if path:
        path = _coerce("tenant_secret_file", path, "")
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(
                f"kv_connector_extra_config.tenant_secret_file: cannot read "
                f"{path!r} ({exc.strerror})"
            ) from None
        if not secret:
            raise ValueError(
                f"kv_connector_extra_config.tenant_secret_file: {path!r} is empty"
            )
        return secret
    if inline is not None:
        if not isinstance(inline, str) or not inline.strip():
            raise ValueError(
                "kv_connector_extra_config.tenant_secret: expected a non-empty string"
            )
        logger.warning(
            "pegaflow: kv_connector_extra_config.tenant_secret puts the secret "
            "where `ps` and logs show it; use tenant_secret_file (a file only "
            "the engine's user can read) or PEGAFLOW_TENANT_SECRET instead"
        )
        return inline.strip().encode()
    return env.get("PEGAFLOW_TENANT_SECRET", "").strip().encode()


def _original_keys(
    extra: dict[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], Mapping[str, str]]:
    """The original connector's `pegaflow.*` keys -> ours. As there, the
    PEGAFLOW_HOST / PEGAFLOW_PORT environment wins over pegaflow.host/.port."""
    ours = {k: v for k, v in extra.items() if not k.startswith("pegaflow.")}
    theirs = {k: v for k, v in extra.items() if k.startswith("pegaflow.")}
    given = dict(env)
    endpoints = theirs.pop("pegaflow.tp_shard_endpoints", None)
    if endpoints is not None:
        if not isinstance(endpoints, list) or len(endpoints) != 1:
            raise ValueError(
                "kv_connector_extra_config.pegaflow.tp_shard_endpoints: one "
                "server per TP replica here; a replica spanning hosts is not "
                "supported yet"
            )
        host, _, port = str(endpoints[0]).rpartition(":")
        theirs.setdefault("pegaflow.host", host)
        theirs.setdefault("pegaflow.port", port)
    for key, var in (
        ("pegaflow.host", "PEGAFLOW_HOST"),
        ("pegaflow.port", "PEGAFLOW_PORT"),
    ):
        if key in theirs:
            value = theirs.pop(key)
            if not given.get(var):
                given[var] = str(value)
    if "pegaflow.mode" in theirs:
        ours.setdefault("mode", theirs.pop("pegaflow.mode"))
    for key, why in ORIGINAL_IGNORED.items():
        if theirs.pop(key, None) not in (None, False):
            logger.warning(
                "pegaflow: kv_connector_extra_config.%s is accepted and ignored: %s",
                key,
                why,
            )
    ours.update(theirs)  # anything left is unknown: named below
    return ours, given


def failure_policy_warning(policy: str | None) -> str | None:
    """The line to log for vLLM's kv_load_failure_policy, if any."""
    if policy != "fail":
        return None
    return (
        "pegaflow: kv_load_failure_policy is 'fail' (vLLM's default): a load "
        "the server cannot finish (server restarted or gone) fails the request; "
        'set "kv_load_failure_policy": "recompute" to recompute those blocks'
    )


def resolved_poll(config: ConnectorConfig, device_type: str | None) -> ConnectorConfig:
    """`config` with an auto busy_poll_us made concrete for vLLM's device
    type ("cuda", "cpu", ...; None where vLLM does not say: no polling)."""
    if config.busy_poll_us != AUTO_BUSY_POLL:
        return config
    us = GPU_ENGINE_BUSY_POLL_US if device_type == "cuda" else 0
    return replace(config, busy_poll_us=us)


def parse_config(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorConfig:
    """The connector's config from vLLM's extra config and the environment."""
    env = os.environ if env is None else env
    extra, env = _original_keys(dict(extra or {}), env)
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
            f"PegaKVConnector accepts {', '.join(sorted(_KEYS))}"
        )
    secret = _tenant_secret(extra, env)
    values = {k: _coerce(k, v, _KEYS[k].default) for k, v in extra.items()}
    return ConnectorConfig(addr=server_addr(env), tenant_secret=secret, **values)
