"""The tenant secret: mixed into the namespace digest (HMAC), given by a file or
the environment, and never written to a log."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from pegaflow.connector.extra_config import parse_config
from pegaflow.connector.registrar import Registrar
from pegaflow.connector.tensors import kv_tensors, namespace_digest, namespace_parts

SECRET = "s3cr3t-tenant-key-0123456789"
PARTS = {"model": "m", "layers": 2, "salt": ""}


def test_secret_changes_the_digest_and_no_secret_keeps_it() -> None:
    """Regression: the namespace was a plain digest of guessable parts; with a
    secret it is an HMAC, other for every secret. Without one it stays the
    digest it always was (blocks already cached keep their namespace)."""
    plain = namespace_digest(PARTS)
    text = json.dumps(PARTS, sort_keys=True, default=str).encode()
    assert plain == "vllm-" + hashlib.sha256(text).hexdigest()[:40]
    keyed = namespace_digest(PARTS, SECRET.encode())
    assert keyed != plain and keyed.startswith("vllm-") and len(keyed) == 45
    assert keyed == namespace_digest(dict(PARTS), SECRET.encode())
    assert keyed != namespace_digest(PARTS, b"another")


def test_file_and_env_give_the_same_secret(tmp_path: Path) -> None:
    """Regression: tenant_secret_file was an unknown key. The file's secret
    (its trailing newline is not part of it) and PEGAFLOW_TENANT_SECRET give
    one config; a named file wins over the environment; repr hides it."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    by_file = parse_config({"tenant_secret_file": str(path)}, env={})
    by_env = parse_config({}, env={"PEGAFLOW_TENANT_SECRET": SECRET})
    assert by_file.tenant_secret == by_env.tenant_secret == SECRET.encode()
    both = parse_config(
        {"tenant_secret_file": str(path)}, env={"PEGAFLOW_TENANT_SECRET": "other"}
    )
    assert both.tenant_secret == SECRET.encode()
    assert parse_config({}, env={}).tenant_secret == b""
    assert SECRET not in repr(by_file) and SECRET not in repr(by_env)


def test_secret_in_the_json_config_is_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG):
        cfg = parse_config({"tenant_secret": SECRET}, env={})
    assert cfg.tenant_secret == SECRET.encode()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "tenant_secret_file" in warned[0].getMessage()
    assert SECRET not in caplog.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tenant_secret_file": "/nonexistent/secret"}, "cannot read"),
        ({"tenant_secret_file": "EMPTY"}, "is empty"),
        ({"tenant_secret_file": "FILE", "tenant_secret": SECRET}, "not both"),
        ({"tenant_secret": 12345678}, "expected a non-empty string"),
    ],
)
def test_bad_secret_options(tmp_path: Path, extra: dict, message: str) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "file").write_text(SECRET)
    paths = {"EMPTY": str(tmp_path / "empty"), "FILE": str(tmp_path / "file")}
    extra = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in extra.items()}
    with pytest.raises(ValueError, match=message) as err:
        parse_config(extra, env={})
    assert SECRET not in str(err.value) and "12345678" not in str(err.value)


def test_registrar_namespace_uses_the_secret_and_logs_never_show_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the worker's namespace ignored any secret. Now two workers
    of one model differ exactly when their secrets do, and the registrar's
    log line (the namespace's parts) never carries the secret."""
    pytest.importorskip("torch")
    from tests.connector.test_tensors_stats import config, views

    path = tmp_path / "secret"
    path.write_text(SECRET)

    def namespace(extra: dict, env: dict[str, str]) -> str:
        reg = Registrar(None, parse_config(extra, env=env), "i", 0, 1, None)
        reg.describe(views("NHC"), 8, config())
        return reg.namespace

    with caplog.at_level(logging.DEBUG):
        plain = namespace({}, {})
        by_file = namespace({"tenant_secret_file": str(path)}, {})
        by_env = namespace({}, {"PEGAFLOW_TENANT_SECRET": SECRET})
        other = namespace({}, {"PEGAFLOW_TENANT_SECRET": "other"})
    kv = kv_tensors(views("NHC"), 8)
    assert plain == namespace_digest(namespace_parts(config(), kv, ""))
    assert by_file == by_env and len({plain, by_file, other}) == 3
    assert "tenant secret: yes" in caplog.text
    assert SECRET not in caplog.text
