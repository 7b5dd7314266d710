"""`security:`, a pipeline's TLS, client tokens and mesh membership.

    security:
      tls:
        cert: certs/mesh.pem        # the chain every service presents (PEM)
        key: certs/mesh.key
        ca: certs/ca.pem            # what peers are verified against
        mutual: true                # stages' servers require a certificate from `ca`
      tokens_file: secrets/tokens   # bearer tokens the client API accepts, one per line:
                                    # "TOKEN" or "TOKEN,PRINCIPAL" (the caller's name)
      mesh_secret_file: secrets/mesh  # what a stage shows to Attach and Deliver
      quotas:                       # per principal: limits, and shares under overload
        default: {weight: 1, max_live_requests: 64}
        principals:
          web: {weight: 4, requests_per_s: 50}

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
import re
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


# A principal's name: what a tokens-file line calls its caller; it shows in spans, logs and
# metric labels, so it is short and plain.
PRINCIPAL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
# The principal of calls without a token (a mesh that configures none).
ANONYMOUS = "anonymous"


class Quota(_Model):
    """One principal's limits and its share of the mesh under overload. Every limit is
    optional; a request over one is refused with RESOURCE_EXHAUSTED and a retry hint."""

    weight: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="Its share of `max_live_requests` when the mesh is full, against the "
        "weights of the other principals with requests running (0: none guaranteed; it "
        "gets in only while the mesh has room).",
    )
    max_live_requests: int | None = Field(
        None, ge=1, description="Requests of this principal running at once."
    )
    requests_per_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Requests started per second, on average (a token bucket).",
    )
    burst: int | None = Field(
        None,
        ge=1,
        description="Requests that may start at once above `requests_per_s` (the bucket's "
        "size); unset: one second's worth, at least 1.",
    )

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> Quota:
        if self.burst is not None and self.requests_per_s is None:
            raise ValueError("burst: needs requests_per_s (the rate the bucket refills at)")
        return self


class QuotasConfig(_Model):
    """`security.quotas`: limits per principal, and how a full mesh is shared among them.

    Principals are the names the tokens file gives its tokens; a principal not listed in
    `principals` has the `default` quota. When `max_live_requests` requests are running, a
    principal below its weighted share (of the principals with requests running) is still
    let in, up to that share, and one at or above it is refused: a caller sending far more
    than the mesh serves is refused before a quiet one is."""

    default: Quota = Field(
        default_factory=Quota, description="The quota of every principal not listed."
    )
    principals: dict[str, Quota] = Field(
        default_factory=dict,
        description="Quotas by principal name (each must be named by a token).",
    )

    @field_validator("principals")
    @classmethod
    def _names(cls, principals: dict[str, Quota]) -> dict[str, Quota]:
        for name in principals:
            if not PRINCIPAL_RE.fullmatch(name):
                raise ValueError(
                    f"{name[:80]!r}: a principal is 1-64 characters of [A-Za-z0-9._@-], "
                    "starting with a letter or digit"
                )
        return principals

    @model_validator(mode="after")
    def _some_weight(self) -> QuotasConfig:
        if self.default.weight == 0 and all(q.weight == 0 for q in self.principals.values()):
            raise ValueError(
                "weight: the weights (default.weight and every principals.*.weight) sum to "
                "zero: no principal would get any share of a full mesh"
            )
        return self

    def of(self, principal: str) -> Quota:
        """The quota `principal` has."""
        return self.principals.get(principal, self.default)


class SecurityConfig(_Model):
    """`security:`: TLS, client tokens and mesh membership (off when empty)."""

    tls: TLSConfig | None = Field(None, description="TLS on every hop; unset: plaintext.")
    tokens_file: str | None = _path(
        "A file of bearer tokens the client API accepts, one per line (# comments): `TOKEN`, "
        "or `TOKEN,PRINCIPAL` to name the caller it identifies (env `OMNIRAIL_TOKENS_FILE`)."
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
    quotas: QuotasConfig | None = Field(
        None,
        description="Limits per principal and fair shares under overload; unset: one "
        "mesh-wide `max_live_requests`, first come first served.",
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
