"""How a client dials the coordinator: TLS or not, which CA, which bearer token.

Explicit arguments win; otherwise the environment decides, so code written for a local mesh
runs unchanged inside a secured deployment: ``OMNIRAIL_TOKEN`` holds the bearer token and
``OMNIRAIL_TLS_CA`` the CA bundle that turns TLS on (the same variable the mesh's own
processes read).
"""

from __future__ import annotations

import os
from typing import Any

import grpc

from omnirail.config.security import ENV_CA, ENV_SERVER_NAME
from omnirail.transport.deliver import channel_options
from omnirail.transport.security import MeshSecurity, secure_channel, token_metadata

TOKEN_ENV = "OMNIRAIL_TOKEN"


def client_channel(
    address: str,
    *,
    tls: bool | str | None,
    token: str | None,
    server_name: str | None,
    max_message_bytes: int,
    aio: bool,
) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """A channel to `address` and the metadata every call on it carries.

    `tls`: False plaintext, True TLS checked against the system's roots, a path TLS checked
    against that CA bundle, None from ``OMNIRAIL_TLS_CA`` (plaintext when unset).
    """
    if tls is None:
        tls = os.environ.get(ENV_CA) or False
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if server_name is None:
        server_name = os.environ.get(ENV_SERVER_NAME) or None
    options = channel_options(max_message_bytes)
    credentials = None
    if tls is not False:
        roots = None
        if isinstance(tls, str):
            try:
                with open(tls, "rb") as f:
                    roots = f.read()
            except OSError as exc:
                raise ValueError(f"tls: cannot read CA bundle {tls!r}: {exc.strerror}") from None
        credentials = grpc.ssl_channel_credentials(roots)
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
    if token is not None and (not token.strip() or any(c in token for c in "\r\n")):
        raise ValueError("token: must be non-empty and on one line")
    channel = secure_channel(address, credentials, options, aio=aio)
    return channel, token_metadata(token)


def client_options(security: MeshSecurity) -> dict[str, Any]:
    """`Client` arguments for a mesh secured by `security`: its CA, a token, its name."""
    tls = security.config.tls
    return {
        "tls": (tls.ca or True) if tls is not None else False,
        "token": security.client_token(),
        "server_name": tls.server_name if tls is not None else None,
    }
