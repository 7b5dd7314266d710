"""TLS credentials, bearer tokens and mesh membership for every gRPC hop.

One `MeshSecurity` per process, built from the pipeline's `security:` section with the
environment on top (see `omnirail.config.security`). It reads every file once, at start,
and fails then with the file named, not at the first request.

Who must prove what, by method:
- ``grpc.health.v1.Health``: nobody (probes from compose, Kubernetes and `omnirail status`
  carry no credentials; health says nothing a stranger could use).
- ``omnirail.v1.Coordinator`` (Attach) and ``omnirail.v1.Stage`` (Deliver): mesh members,
  by the mesh secret in ``omnirail-mesh-secret`` metadata; with ``tls.mutual`` the stages'
  servers also require a client certificate from the mesh CA.
- everything else (the client API, reflection, the front doors): a bearer token in
  ``authorization: Bearer <token>`` metadata, when tokens are configured.
Secrets are compared as SHA-256 digests with `hmac.compare_digest` against every accepted
value, so neither a token's content nor its length shows in the time an answer takes, and
they never appear in a log line or an error.

Principals: a tokens-file line `TOKEN,NAME` names the caller its token identifies; a bare
`TOKEN` line is the principal `token-<8 hex digits of its SHA-256>` (stable, and saying
nothing usable about the token). Without tokens every caller is `anonymous`. A front door
that verified its own callers (the HTTP gateway) names the principal of each request in
`GenerateRequest.on_behalf_of`; the coordinator takes it only from a call that also shows
the mesh secret (`MeshSecurity.caller`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from omnirail.config import PipelineConfig
from omnirail.config.security import ANONYMOUS, PRINCIPAL_RE, SecurityConfig
from omnirail.wire.errors import Code, OmniError

log = logging.getLogger(__name__)

MESH_SECRET_KEY = "omnirail-mesh-secret"
AUTHORIZATION_KEY = "authorization"
# Token files are small; a bound keeps a mistaken path (a disk image) from being read.
_MAX_SECRET_FILE = 1 << 20
_NAME_OVERRIDE = "grpc.ssl_target_name_override"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_MESH_PREFIXES = ("/omnirail.v1.Coordinator/", "/omnirail.v1.Stage/")


class SecurityError(ValueError):
    """Security material that cannot be used: a missing or unreadable file, an empty one."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_SECRET_FILE + 1)
    except OSError as exc:
        raise SecurityError(f"{what} {path!r}: {exc.strerror or exc}") from None
    if len(data) > _MAX_SECRET_FILE:
        raise SecurityError(f"{what} {path!r}: larger than {_MAX_SECRET_FILE} bytes")
    if not data.strip():
        raise SecurityError(f"{what} {path!r}: empty")
    return data


def _digest(secret: str | bytes) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).digest()


def secret_lines(data: bytes) -> list[bytes]:
    """The secrets of a tokens or secret file: one per line, blank lines and # comments
    skipped (the one format for every reader of such files)."""
    return [
        line for raw in data.splitlines() if (line := raw.strip()) and not line.startswith(b"#")
    ]


def _lines(data: bytes, what: str, path: str) -> list[bytes]:
    out = secret_lines(data)
    if not out:
        raise SecurityError(f"{what} {path!r}: no secret in it (only blank or # lines)")
    return out


def _secrets(path: str, what: str) -> list[bytes]:
    return _lines(_read(path, what), what, path)


def unnamed_principal(token: bytes) -> str:
    """The principal of a token whose line names none."""
    return "token-" + hashlib.sha256(token).hexdigest()[:8]


def token_entry(line: bytes, where: str) -> tuple[bytes, str]:
    """A tokens-file line as (token, principal): `TOKEN` or `TOKEN,PRINCIPAL`. SecurityError
    names `where` (the file and line) for a bad principal, and never shows the token."""
    token, comma, name = line.partition(b",")
    token = token.strip()
    if not token:
        raise SecurityError(f"{where}: no token before the comma")
    if not comma:
        return token, unnamed_principal(token)
    try:
        principal = name.strip().decode("ascii")
    except UnicodeDecodeError:
        principal = ""
    if not PRINCIPAL_RE.fullmatch(principal):
        raise SecurityError(
            f"{where}: the principal after the comma must be 1-64 characters of "
            "[A-Za-z0-9._@-], starting with a letter or digit"
        )
    return token, principal


class SecretSet:
    """Accepted secrets, kept as digests, each with the principal it identifies; `matches`
    and `lookup` take the same time whichever matches."""

    def __init__(self, secrets: Sequence[bytes], names: Sequence[str] | None = None) -> None:
        self._digests = [_digest(s) for s in secrets]
        self._names = list(names) if names is not None else [""] * len(self._digests)
        if len(self._names) != len(self._digests):
            raise ValueError("SecretSet: one name per secret")

    def __bool__(self) -> bool:
        return bool(self._digests)

    @property
    def principals(self) -> frozenset[str]:
        return frozenset(self._names)

    def matches(self, presented: str | bytes) -> bool:
        return self.lookup(presented) is not None

    def lookup(self, presented: str | bytes) -> str | None:
        """The principal of the secret `presented` is, None when it is none of them."""
        digest = _digest(presented)
        found: str | None = None
        for accepted, name in zip(self._digests, self._names, strict=True):
            # No early exit: every entry is compared.
            if hmac.compare_digest(digest, accepted):
                found = name
        return found


class MeshSecurity:
    """What one process needs to serve and dial securely."""

    def __init__(self, config: SecurityConfig | None, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        config = (config or SecurityConfig()).with_environment(environ)
        self.config = config
        tls = config.tls
        self.tls = tls is not None
        self.mutual = bool(tls and tls.mutual)
        self._cert = _read(tls.cert, "tls.cert") if tls else None
        self._key = _read(tls.key, "tls.key") if tls else None
        self._ca = _read(tls.ca, "tls.ca") if tls and tls.ca else None
        self.server_name = tls.server_name if tls else None
        entries: list[tuple[bytes, str]] = []
        if config.tokens_file:
            lines = _secrets(config.tokens_file, "tokens_file")
            entries += [
                token_entry(line, f"tokens_file {config.tokens_file!r}, token {i}")
                for i, line in enumerate(lines, 1)
            ]
        # This process's own client calls (the CLI's) use the file's first token.
        self._client_token = entries[0][0].decode() if entries else None
        if config.tokens_env:
            value = environ.get(config.tokens_env, "").strip()
            if not value:
                raise SecurityError(f"tokens_env: ${config.tokens_env} is not set or empty")
            entries.append(token_entry(value.encode(), f"tokens_env ${config.tokens_env}"))
        self.tokens = SecretSet([t for t, _ in entries], [n for _, n in entries])
        self.quotas = config.quotas
        self._check_quota_principals()
        secret = None
        if config.mesh_secret_file:
            secret = _secrets(config.mesh_secret_file, "mesh_secret_file")[0]
        self._mesh_secret = secret
        self.mesh_secrets = SecretSet([secret] if secret else [])

    @property
    def enabled(self) -> bool:
        return self.tls or bool(self.tokens) or self._mesh_secret is not None

    @property
    def principals(self) -> frozenset[str]:
        """Every principal a caller can be."""
        return self.tokens.principals if self.tokens else frozenset((ANONYMOUS,))

    def _check_quota_principals(self) -> None:
        """Quotas name principals the tokens do: a quota for a name no token carries would
        limit nobody (a typo, or a token file of another mesh)."""
        if self.quotas is None:
            return
        known = self.principals
        for name in self.quotas.principals:
            if name not in known:
                source = "tokens_file or tokens_env" if self.tokens else "any token (none set)"
                raise SecurityError(
                    f"security.quotas.principals.{name}: unknown principal: no token of "
                    f"{source} names it"
                )

    def caller(self, metadata: Sequence[tuple[str, str | bytes]], on_behalf_of: str = "") -> str:
        """The principal of a client call with `metadata` (its bearer token's, checked by
        the interceptor already), or `on_behalf_of` where the call shows the mesh secret
        (a front door of this mesh forwarding the principal it verified). OmniError
        PERMISSION_DENIED for `on_behalf_of` from anyone else, INVALID_ARGUMENT for a
        malformed one."""
        if on_behalf_of:
            if not PRINCIPAL_RE.fullmatch(on_behalf_of):
                raise OmniError(
                    Code.INVALID_ARGUMENT,
                    "on_behalf_of: a principal is 1-64 characters of [A-Za-z0-9._@-]",
                )
            secret = _value(metadata, MESH_SECRET_KEY)
            if not self.mesh_secrets or secret is None or not self.mesh_secrets.matches(secret):
                raise OmniError(
                    Code.PERMISSION_DENIED,
                    "on_behalf_of: only a front door of this mesh (showing the mesh secret) "
                    "may name the principal a request is for",
                )
            return on_behalf_of
        if not self.tokens:
            return ANONYMOUS
        header = _value(metadata, AUTHORIZATION_KEY)
        scheme, _, token = (header or "").partition(" ")
        principal = self.tokens.lookup(token.strip()) if scheme.lower() == "bearer" else None
        # The interceptor refused calls without a valid token; reaching here without one
        # means a server built without it (tests): treat the call as nobody's.
        return principal or ANONYMOUS

    def warnings(self, listen: str) -> list[str]:
        """What this configuration leaves open, for the coordinator to say at start."""
        out = []
        if (self.tls or self.tokens) and not self.mesh_secrets:
            out.append(
                "no mesh_secret_file: any process that reaches the coordinator can Attach "
                "as a stage"
            )
        if self.tokens and not self.tls and not listen.startswith("unix:"):
            out.append("bearer tokens without TLS on TCP: anyone on the path can read them")
        return out

    # ---- serving -------------------------------------------------------------

    def server_credentials(self, *, internal: bool) -> grpc.ServerCredentials | None:
        """TLS for a server; `internal` (a stage's server) requires client certificates
        when the mesh is mutual. None: plaintext."""
        if not self.tls:
            return None
        assert self._key is not None and self._cert is not None
        require = internal and self.mutual
        return grpc.ssl_server_credentials(
            [(self._key, self._cert)],
            root_certificates=self._ca if require else None,
            require_client_auth=require,
        )

    def metrics_tls(self) -> ssl.SSLContext | None:
        """TLS for this process's `/metrics` endpoint: the mesh's certificate, and when the
        mesh is mutual a client certificate from its CA required (a scraper is a peer, not
        a client of the API). None: plaintext."""
        tls = self.config.tls
        if tls is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(tls.cert, tls.key)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityError(f"tls.cert {tls.cert!r} / tls.key {tls.key!r}: {exc}") from None
        if self.mutual and self._ca is not None:
            context.load_verify_locations(cadata=self._ca.decode())
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def interceptor(self) -> grpc.aio.ServerInterceptor | None:
        if not self.tokens and not self.mesh_secrets:
            return None
        return AuthInterceptor(self.tokens, self.mesh_secrets)

    # ---- dialling ------------------------------------------------------------

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS for a mesh-internal channel (with this process's certificate when mutual)."""
        if not self.tls:
            return None
        if self.mutual:
            return grpc.ssl_channel_credentials(self._ca, self._key, self._cert)
        return grpc.ssl_channel_credentials(self._ca)

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.tls and self.server_name:
            return [(_NAME_OVERRIDE, self.server_name)]
        return []

    def mesh_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a stage sends with Attach and Deliver to show it belongs."""
        if self._mesh_secret is None:
            return ()
        return ((MESH_SECRET_KEY, self._mesh_secret.decode()),)

    def client_token(self) -> str | None:
        """A token for this process's own client calls (the CLI's), if tokens are set."""
        if self._client_token is None and self.config.tokens_env:
            return os.environ.get(self.config.tokens_env) or None
        return self._client_token


def secure_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    *,
    aio: bool,
) -> Any:
    """`address` dialled with TLS when `credentials` are given, plaintext otherwise."""
    module: Any = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(address, options=list(options))
    options = list(options)
    if address.startswith("unix:") and not any(k == _NAME_OVERRIDE for k, _ in options):
        # grpc checks a unix socket's certificate against the socket's path; the mesh's
        # certificates name "localhost" for local peers.
        options.append((_NAME_OVERRIDE, "localhost"))
    return module.secure_channel(address, credentials, options=options)


def mesh_channel(
    security: MeshSecurity | None, address: str, options: Sequence[tuple[str, Any]], *, aio: bool
) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """A channel to another process of the mesh, dialled as the mesh's own processes dial
    (its TLS, its certificate where mutual), and the metadata that shows membership."""
    if security is None:
        return secure_channel(address, None, options, aio=aio), ()
    options = [*options, *security.channel_options()]
    channel = secure_channel(address, security.channel_credentials(), options, aio=aio)
    return channel, security.mesh_metadata()


class _Throttled:
    """At most one log line a second per kind of refusal; the rest are counted."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._muted: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, 0.0) < 1.0:
            self._muted[kind] = self._muted.get(kind, 0) + 1
            return
        muted = self._muted.pop(kind, 0)
        self._last[kind] = now
        suffix = f" ({muted} more refused since the last line)" if muted else ""
        log.warning(message + suffix, *args)


def _value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    return _value(details.invocation_metadata, key)  # type: ignore[attr-defined]


def _refuse(
    handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler | None:
    """A handler of `handler`'s kind that answers `code` without running anything."""
    if handler is None:
        return None

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # an async generator, as stream-response handlers are

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    kind = (handler.request_streaming, handler.response_streaming)
    return kinds[kind](
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call's credentials against its method's policy (see the module doc)."""

    def __init__(self, tokens: SecretSet, mesh_secrets: SecretSet) -> None:
        self._tokens = tokens
        self._mesh = mesh_secrets
        self._log = _Throttled()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = details.method  # type: ignore[attr-defined]
        refusal = self.check(method, details)
        handler = await continuation(details)
        if refusal is None:
            return handler
        return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, refusal)

    def check(self, method: str, details: grpc.HandlerCallDetails) -> str | None:
        """None when the call may go on; otherwise why not (for the caller)."""
        if method.startswith(_OPEN_PREFIXES):
            return None
        if method.startswith(_MESH_PREFIXES):
            if not self._mesh:
                return None
            secret = _metadata(details, MESH_SECRET_KEY)
            if secret is not None and self._mesh.matches(secret):
                return None
            # A stranger trying to join or feed the mesh: always worth a line.
            self._log.warn(
                "mesh", "refused %s: %s mesh secret", method, "wrong" if secret else "no"
            )
            return "not a member of this mesh: a valid mesh secret is required"
        if not self._tokens:
            return None
        header = _metadata(details, AUTHORIZATION_KEY)
        if header is None:
            self._log.warn("token", "refused %s: no bearer token", method)
            return "missing bearer token: send metadata 'authorization: Bearer <token>'"
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            self._log.warn("token", "refused %s: authorization is not a bearer token", method)
            return "authorization metadata must be 'Bearer <token>'"
        if not self._tokens.matches(token.strip()):
            self._log.warn("token", "refused %s: wrong bearer token", method)
            return "invalid bearer token"
        return None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (none without one)."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()


def mesh_security(
    pipeline: PipelineConfig, environ: Mapping[str, str] | None = None
) -> MeshSecurity:
    """The security of a process of `pipeline`: its `security:` section, paths relative to
    its file, the environment on top."""
    return MeshSecurity(pipeline.security.resolved(pipeline.source_dir), environ)
