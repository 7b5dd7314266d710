"""`security:`, a pipeline's TLS, client tokens and mesh membership.

    security:
      tls:
        cert: certs/mesh.pem        # the chain every service presents (PEM)
        key: certs/mesh.key
        ca: certs/ca.pem            # what peers are verified against
        mutual: true                # stages' servers require a certificate from `ca`
      tokens_file: secrets/tokens   # bearer tokens the client API accepts, one per line
      mesh_secret_file: secrets/mesh  # what a stage shows to Attach and Deliver

Relative paths are relative to the config file. Every field can be set (or overridden) by
the environment the services start with, which is how `omnirail up --tls auto` and
`omnirail compose --tls` hand generated material to every process: `OMNIRAIL_TLS_CERT`,
`OMNIRAIL_TLS_KEY`, `OMNIRAIL_TLS_CA`, `OMNIRAIL_TLS_MUTUAL` (1/0),
`OMNIRAIL_TLS_SERVER_NAME`, `OMNIRAIL_TOKENS_FILE`, `OMNIRAIL_TOKENS_ENV`,
`OMNIRAIL_MESH_SECRET_FILE`. Only file paths and variable names live in the config: the
secrets themselves never do, so the config can be logged and shared.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

ENV_CERT = "OMNIRAIL_TLS_CERT"
ENV_KEY = "OMNIRAIL_TLS_KEY"
ENV_CA = "OMNIRAIL_TLS_CA"
ENV_MUTUAL = "OMNIRAIL_TLS_MUTUAL"
ENV_SERVER_NAME = "OMNIRAIL_TLS_SERVER_NAME"
ENV_TOKENS_FILE = "OMNIRAIL_TOKENS_FILE"
ENV_TOKENS_ENV = "OMNIRAIL_TOKENS_ENV"
ENV_MESH_SECRET_FILE = "OMNIRAIL_MESH_SECRET_FILE"
SECURITY_ENV = (
    ENV_CERT,
    ENV_KEY,
    ENV_CA,
    ENV_MUTUAL,
    ENV_SERVER_NAME,
    ENV_TOKENS_FILE,
    ENV_TOKENS_ENV,
    ENV_MESH_SECRET_FILE,
)


def _path(description: str, default: str | None = None) -> str | None:
    return Field(  # type: ignore[no-any-return]
        default, min_length=1, max_length=4096, description=description
    )


def _flag(name: str, value: str) -> bool:
    """A yes/no environment variable; anything else is refused rather than read as no (a
    mistyped OMNIRAIL_TLS_MUTUAL must not turn client certificates off unseen)."""
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1 or 0 (true/false, yes/no, on/off)")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TLSConfig(_Model):
    """`security.tls`: the certificate every service presents and what peers are checked
    against. Paths are relative to the pipeline file."""

    cert: str = Field(
        min_length=1,
        max_length=4096,
        description="PEM certificate chain every service presents (env `OMNIRAIL_TLS_CERT`).",
    )
    key: str = Field(
        min_length=1,
        max_length=4096,
        description="PEM private key of `cert` (env `OMNIRAIL_TLS_KEY`).",
    )
    ca: str | None = _path(
        "PEM CA bundle peers are verified against; unset: the system's roots (a public "
        "CA's certificates) (env `OMNIRAIL_TLS_CA`)."
    )
    # The coordinator's port also serves clients, who have no certificate: there membership
    # is the mesh secret (see `SecurityConfig.mesh_secret_file`).
    mutual: bool = Field(
        False,
        description="The stages' servers (and the metrics endpoints) require a client "
        "certificate signed by `ca` (env `OMNIRAIL_TLS_MUTUAL`).",
    )
    server_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="The name the servers' certificate is checked against when it is not "
        'the dialled host (a certificate for "omnirail.internal" served on 10.0.0.5) (env '
        "`OMNIRAIL_TLS_SERVER_NAME`).",
    )

    @model_validator(mode="after")
    def _mutual_needs_ca(self) -> TLSConfig:
        if self.mutual and self.ca is None:
            raise ValueError("mutual: needs ca (the CA client certificates are checked against)")
        return self


class SecurityConfig(_Model):
    """`security:`: TLS, client tokens and mesh membership (off when empty)."""

    tls: TLSConfig | None = Field(None, description="TLS on every hop; unset: plaintext.")
    tokens_file: str | None = _path(
        "A file of bearer tokens the client API accepts, one per line (# comments) (env "
        "`OMNIRAIL_TOKENS_FILE`)."
    )
    tokens_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description="The name of an environment variable holding one more accepted token "
        "(env `OMNIRAIL_TOKENS_ENV`).",
    )
    mesh_secret_file: str | None = _path(
        "A file holding the mesh's membership secret, which stages present when they Attach "
        "and Deliver (env `OMNIRAIL_MESH_SECRET_FILE`)."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tls or self.tokens_file or self.tokens_env or self.mesh_secret_file)

    def resolved(self, base_dir: str | None) -> SecurityConfig:
        """Paths made absolute against `base_dir` (the config file's folder)."""

        def absolute(path: str | None) -> str | None:
            if path is None or base_dir is None:
                return path
            return str(Path(base_dir, path)) if not os.path.isabs(path) else path

        tls = self.tls
        if tls is not None:
            tls = tls.model_copy(
                update={
                    "cert": absolute(tls.cert),
                    "key": absolute(tls.key),
                    "ca": absolute(tls.ca),
                }
            )
        return self.model_copy(
            update={
                "tls": tls,
                "tokens_file": absolute(self.tokens_file),
                "mesh_secret_file": absolute(self.mesh_secret_file),
            }
        )

    def with_environment(self, environ: Mapping[str, str]) -> SecurityConfig:
        """This config with what `environ` sets (OMNIRAIL_TLS_* and friends) on top."""
        data = self.model_dump()
        tls = dict(data.get("tls") or {})
        for env, field in (
            (ENV_CERT, "cert"),
            (ENV_KEY, "key"),
            (ENV_CA, "ca"),
            (ENV_SERVER_NAME, "server_name"),
        ):
            if environ.get(env):
                tls[field] = environ[env]
        if environ.get(ENV_MUTUAL):
            tls["mutual"] = _flag(ENV_MUTUAL, environ[ENV_MUTUAL])
        if tls:
            data["tls"] = tls
        for env, field in (
            (ENV_TOKENS_FILE, "tokens_file"),
            (ENV_TOKENS_ENV, "tokens_env"),
            (ENV_MESH_SECRET_FILE, "mesh_secret_file"),
        ):
            if environ.get(env):
                data[field] = environ[env]
        return SecurityConfig.model_validate(data)
