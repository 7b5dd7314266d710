"""Principals: a tokens file names its callers, and only the mesh's own front doors may
name the principal a request is for."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from omnirail.config.security import ANONYMOUS, SecurityConfig
from omnirail.transport.security import (
    MESH_SECRET_KEY,
    MeshSecurity,
    SecretSet,
    SecurityError,
    token_entry,
    token_metadata,
    unnamed_principal,
)
from omnirail.wire.errors import Code, OmniError

TOKENS = b"""# callers of this mesh
s3cret-web,web
s3cret-batch , batch-team
legacy-token-no-name
s3cret-web-2,web
"""


def _security(tmp_path: Path, tokens: bytes = TOKENS, **config: object) -> MeshSecurity:
    path = tmp_path / "tokens"
    path.write_bytes(tokens)
    (tmp_path / "mesh").write_bytes(b"mesh-secret\n")
    return MeshSecurity(
        SecurityConfig.model_validate(
            {"tokens_file": str(path), "mesh_secret_file": str(tmp_path / "mesh"), **config}
        ),
        environ={},
    )


def test_a_line_is_a_token_or_a_token_and_its_principal() -> None:
    assert token_entry(b"abc,web", "here") == (b"abc", "web")
    assert token_entry(b"abc , web ", "here") == (b"abc", "web")
    # The current one-token-a-line format stays valid: a stable name that shows no token.
    token, name = token_entry(b"abc", "here")
    assert token == b"abc" and name == unnamed_principal(b"abc") and "abc" not in name
    assert name.startswith("token-") and len(name) == 14


@pytest.mark.parametrize("line", [b"zq9,", b"zq9,has space", b"zq9,\xff", b",web", b"zq9,-x"])
def test_a_bad_line_is_refused_naming_where_and_not_showing_the_token(line: bytes) -> None:
    with pytest.raises(SecurityError) as ei:
        token_entry(line, "tokens_file 't', token 3")
    assert "tokens_file 't', token 3" in str(ei.value)
    token = line.partition(b",")[0]
    assert not token or token.decode() not in str(ei.value)


def test_each_token_identifies_its_principal(tmp_path: Path) -> None:
    security = _security(tmp_path)
    assert security.tokens.lookup("s3cret-web") == "web"
    assert security.tokens.lookup("s3cret-web-2") == "web"  # rotation: two tokens, one name
    assert security.tokens.lookup("s3cret-batch") == "batch-team"
    assert security.tokens.lookup("legacy-token-no-name") == unnamed_principal(
        b"legacy-token-no-name"
    )
    assert security.tokens.lookup("s3cret-web,web") is None  # the line is not the token
    assert security.tokens.lookup("nope") is None
    assert security.principals == {
        "web",
        "batch-team",
        unnamed_principal(b"legacy-token-no-name"),
    }
    # The process's own calls (the CLI's) show the first token, not its line.
    assert security.client_token() == "s3cret-web"


def test_the_caller_is_its_token_or_anonymous_without_tokens(tmp_path: Path) -> None:
    security = _security(tmp_path)
    assert security.caller(token_metadata("s3cret-batch")) == "batch-team"
    assert MeshSecurity(SecurityConfig(), environ={}).caller(()) == ANONYMOUS


def test_only_a_member_may_name_the_principal_of_a_request(tmp_path: Path) -> None:
    security = _security(tmp_path)
    member = (*token_metadata("s3cret-web"), (MESH_SECRET_KEY, "mesh-secret"))
    assert security.caller(member, "batch-team") == "batch-team"
    for metadata in (
        token_metadata("s3cret-web"),
        (*token_metadata("s3cret-web"), (MESH_SECRET_KEY, "wrong")),
    ):
        with pytest.raises(OmniError) as ei:
            security.caller(metadata, "batch-team")
        assert ei.value.code == Code.PERMISSION_DENIED and "on_behalf_of" in ei.value.message
    with pytest.raises(OmniError) as ei:
        security.caller(member, "not a name")
    assert ei.value.code == Code.INVALID_ARGUMENT and "on_behalf_of" in ei.value.message
    # A mesh without a secret has no member to trust with it.
    bare = MeshSecurity(SecurityConfig(), environ={})
    with pytest.raises(OmniError):
        bare.caller(((MESH_SECRET_KEY, "anything"),), "web")


def test_a_quota_for_a_principal_no_token_names_is_refused(tmp_path: Path) -> None:
    quotas = {"principals": {"web": {"weight": 2}, "wbe": {"weight": 1}}}
    with pytest.raises(SecurityError) as ei:
        _security(tmp_path, quotas=quotas)
    assert "security.quotas.principals.wbe: unknown principal" in str(ei.value)
    assert _security(tmp_path, quotas={"principals": {"web": {}}}).quotas is not None
    # Without tokens every caller is anonymous, and a quota may name just that.
    with pytest.raises(SecurityError, match=r"principals\.web"):
        MeshSecurity(SecurityConfig.model_validate({"quotas": quotas}), environ={})
    MeshSecurity(
        SecurityConfig.model_validate({"quotas": {"principals": {ANONYMOUS: {}}}}), environ={}
    )


def test_the_tokens_env_line_may_name_its_principal(tmp_path: Path) -> None:
    security = MeshSecurity(
        SecurityConfig(tokens_env="MY_TOKEN"), environ={"MY_TOKEN": "from-env,ops"}
    )
    assert security.tokens.lookup("from-env") == "ops"


def test_lookups_never_log_or_show_tokens(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        security = _security(tmp_path)
        security.caller(token_metadata("s3cret-web"))
    assert "s3cret" not in caplog.text
    assert SecretSet([b"a", b"b"], ["x", "y"]).lookup("b") == "y"
