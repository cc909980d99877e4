"""pegaflow.common.peer_auth: where the token comes from, and the server-side check."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegaflow.common import peer_auth

TOKEN = "t0ken-" + "a" * 20
KEY = peer_auth.METADATA_KEY


def test_flag_then_named_variable_then_file_then_default_variable(
    tmp_path: Path,
) -> None:
    """Each source is used only when the ones before it are absent; the flag
    wins over $PEGAFLOW_PEER_TOKEN; nothing given means no token."""
    env = {peer_auth.ENV_VAR: "from-default-env-x", "MINE": "from-named-env-xx"}
    path = tmp_path / "token"
    path.write_text("from-file-xxxxxxxx\n")
    path.chmod(0o600)
    assert peer_auth.read_token(TOKEN, environ=env) == TOKEN
    assert peer_auth.read_token(env_name="MINE", environ=env) == "from-named-env-xx"
    assert peer_auth.read_token(path=str(path), environ=env) == "from-file-xxxxxxxx"
    assert peer_auth.read_token(environ=env) == "from-default-env-x"
    assert peer_auth.read_token(environ={}) is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"flag": " "}, "peer_token: "),
        ({"env_name": "NOPE"}, "peer_token_env: "),
        ({"environ": {peer_auth.ENV_VAR: ""}}, "peer_token_var: "),
    ],
)
def test_a_given_but_empty_source_is_an_error(kwargs: dict, field: str) -> None:
    kwargs.setdefault("environ", {})
    with pytest.raises(ValueError, match=f"^{field}"):
        peer_auth.read_token(**kwargs)


def test_check_token_bounds_and_alphabet() -> None:
    peer_auth.check_token(TOKEN)
    for bad in ("short", "x" * 4097, "has space " * 3, "tab\there-xxxxxxxxxx"):
        with pytest.raises(ValueError, match="^token: ") as info:
            peer_auth.check_token(bad)
        assert bad not in str(info.value)


def test_refusal_says_missing_or_wrong_and_never_echoes() -> None:
    """No token required: anything passes. Required: none sent is "missing",
    another value (str or bytes, one character off, a prefix) is "wrong", the
    key twice is refused; the right one once passes."""
    want = TOKEN.encode()
    assert peer_auth.refusal(None, None) is None
    assert peer_auth.refusal(None, [(KEY, "anything")]) is None
    assert peer_auth.refusal(want, [(KEY, TOKEN)]) is None
    assert peer_auth.refusal(want, [("other", "x"), (KEY, want)]) is None
    assert "missing" in peer_auth.refusal(want, None)
    assert "missing" in peer_auth.refusal(want, [("x-pegaflow-token", TOKEN)])
    for wrong in (TOKEN[:-1] + "b", TOKEN[:-1], TOKEN.upper().encode()):
        why = peer_auth.refusal(want, [(KEY, wrong)])
        assert why == f"{KEY}: wrong token"
    assert "2 times" in peer_auth.refusal(want, [(KEY, TOKEN), (KEY, TOKEN)])


def test_client_metadata() -> None:
    assert peer_auth.metadata(TOKEN) == ((KEY, TOKEN),)
    assert peer_auth.metadata(None) == peer_auth.metadata("") == ()
