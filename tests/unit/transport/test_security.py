"""MeshSecurity: reading material, the per-method policy, secrets compared safely."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from omnirail.config.security import SecurityConfig
from omnirail.ops.certs import make_mesh_material, material_env
from omnirail.transport.security import (
    MESH_SECRET_KEY,
    AuthInterceptor,
    MeshSecurity,
    SecretSet,
    SecurityError,
    token_metadata,
)


def _details(method: str, *metadata: tuple[str, str]) -> SimpleNamespace:
    return SimpleNamespace(method=method, invocation_metadata=metadata)


def test_a_secret_set_matches_only_its_secrets() -> None:
    accepted = SecretSet([b"alpha", b"beta"])
    assert accepted.matches("alpha") and accepted.matches(b"beta")
    assert not accepted.matches("alph") and not accepted.matches("alphaa")
    assert not accepted.matches("")
    assert not SecretSet([])


def test_the_policy_by_method(caplog: pytest.LogCaptureFixture) -> None:
    check = AuthInterceptor(SecretSet([b"tok"]), SecretSet([b"mesh"])).check
    health = "/grpc.health.v1.Health/Check"
    assert check(health, _details(health)) is None
    session = "/omnirail.v1.Omnirail/Session"
    assert "missing bearer token" in (check(session, _details(session)) or "")
    assert check(session, _details(session, *token_metadata("tok"))) is None
    assert check(session, _details(session, ("authorization", "bearer tok"))) is None
    assert "invalid" in (check(session, _details(session, *token_metadata("tok2"))) or "")
    assert "Bearer" in (check(session, _details(session, ("authorization", "Basic x"))) or "")
    # Reflection is part of the API surface a token guards.
    reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    assert check(reflect, _details(reflect)) is not None
    attach = "/omnirail.v1.Coordinator/Attach"
    with caplog.at_level(logging.WARNING):
        assert "not a member" in (check(attach, _details(attach)) or "")
    assert "refused /omnirail.v1.Coordinator/Attach: no mesh secret" in caplog.text
    # A client token is not membership, and membership is not a client token.
    assert check(attach, _details(attach, *token_metadata("tok"))) is not None
    assert check(attach, _details(attach, (MESH_SECRET_KEY, "mesh"))) is None
    deliver = "/omnirail.v1.Stage/Deliver"
    assert check(deliver, _details(deliver, (MESH_SECRET_KEY, "mesh"))) is None
    assert check(session, _details(session, (MESH_SECRET_KEY, "mesh"))) is not None


def test_refusals_never_log_the_presented_secret(caplog: pytest.LogCaptureFixture) -> None:
    check = AuthInterceptor(SecretSet([b"tok"]), SecretSet([b"mesh"])).check
    with caplog.at_level(logging.DEBUG):
        check("/omnirail.v1.Omnirail/Submit", _details("x", *token_metadata("guess-1")))
        check("/omnirail.v1.Coordinator/Attach", _details("x", (MESH_SECRET_KEY, "guess-2")))
    assert "guess-1" not in caplog.text and "guess-2" not in caplog.text


def test_without_tokens_or_secret_nothing_is_checked() -> None:
    assert MeshSecurity(SecurityConfig(), environ={}).interceptor() is None
    assert not MeshSecurity(None, environ={}).enabled


def test_material_is_read_at_start_and_named_when_wrong(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(SecurityError, match=r"tokens_file .*no secret in it"):
        MeshSecurity(SecurityConfig(tokens_file=str(empty)), environ={})
    with pytest.raises(SecurityError, match=r"mesh_secret_file .*missing.*No such file"):
        MeshSecurity(SecurityConfig(mesh_secret_file=str(tmp_path / "missing")), environ={})
    with pytest.raises(SecurityError, match=r"tokens_env: \$OMNI_T is not set"):
        MeshSecurity(SecurityConfig(tokens_env="OMNI_T"), environ={})
    both = MeshSecurity(SecurityConfig(tokens_env="OMNI_T"), environ={"OMNI_T": " t1 "})
    assert both.tokens.matches("t1") and both.client_token() is None


def test_generated_material_serves_mutual_tls(tmp_path: Path) -> None:
    paths = make_mesh_material(tmp_path / "tls", ["stage-a"])
    assert (paths["mesh.key"].stat().st_mode & 0o777) == 0o600
    assert (paths["mesh-secret"].stat().st_mode & 0o777) == 0o600
    security = MeshSecurity(None, environ=material_env(paths))
    assert security.tls and security.mutual
    assert security.server_credentials(internal=True) is not None
    assert security.channel_credentials() is not None
    assert (
        dict(security.mesh_metadata())[MESH_SECRET_KEY] == paths["mesh-secret"].read_text().strip()
    )


@pytest.mark.parametrize(("value", "mutual"), [("1", True), (" Yes ", True), ("off", False)])
def test_mutual_from_the_environment(tmp_path: Path, value: str, mutual: bool) -> None:
    paths = make_mesh_material(tmp_path / "tls", ["stage-a"])
    environ = {**material_env(paths), "OMNIRAIL_TLS_MUTUAL": value}
    assert MeshSecurity(None, environ=environ).mutual is mutual


def test_a_mistyped_mutual_is_refused_not_read_as_no(tmp_path: Path) -> None:
    paths = make_mesh_material(tmp_path / "tls", ["stage-a"])
    environ = {**material_env(paths), "OMNIRAIL_TLS_MUTUAL": "ture"}
    with pytest.raises(ValueError, match=r"OMNIRAIL_TLS_MUTUAL='ture': expected 1 or 0"):
        MeshSecurity(None, environ=environ)


def test_what_a_configuration_leaves_open_is_said(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("t\n")
    security = MeshSecurity(SecurityConfig(tokens_file=str(tokens)), environ={})
    said = security.warnings("0.0.0.0:50051")
    assert any("can Attach as a stage" in w for w in said)
    assert any("without TLS on TCP" in w for w in said)
    assert not any("TCP" in w for w in security.warnings("unix:///tmp/x.sock"))
    paths = make_mesh_material(tmp_path / "tls")
    assert MeshSecurity(None, environ=material_env(paths)).warnings("0.0.0.0:1") == []
