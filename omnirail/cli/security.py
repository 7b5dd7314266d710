"""Security flags: `up`/`run` (the mesh's TLS, tokens and secret) and clients' (`generate`).

Mesh flags become OMNIRAIL_TLS_* variables for every process the launcher starts, on top of
the pipeline's `security:` section (omnirail/config/security.py). Secrets are only ever
passed as file paths: a token on a command line is visible to every user in `ps`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from omnirail.config import security


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security")
    g.add_argument(
        "--tls",
        choices=["auto"],
        default=None,
        help="auto: a throwaway CA, certificate and mesh secret for this mesh (mutual TLS "
        "inside it); clients verify against RUN_DIR/tls/ca.pem",
    )
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="certificate chain served")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    g.add_argument(
        "--tls-ca", default=None, metavar="PEM", help="CA bundle peers are checked against"
    )
    g.add_argument(
        "--tls-mutual", action="store_true", help="stages' servers require client certificates"
    )
    g.add_argument(
        "--tokens-file", default=None, metavar="FILE", help="bearer tokens the client API accepts"
    )
    g.add_argument(
        "--mesh-secret-file", default=None, metavar="FILE", help="what stages show to join"
    )


def mesh_env(args: argparse.Namespace) -> dict[str, str]:
    """The OMNIRAIL_TLS_* environment the mesh flags ask for (paths made absolute)."""
    if args.tls == "auto" and (args.tls_cert or args.tls_key or args.tls_ca):
        raise ValueError(
            "--tls auto makes its own certificates; drop --tls-cert/--tls-key/--tls-ca"
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    env: dict[str, str] = {}
    for flag, name in (
        (args.tls_cert, security.ENV_CERT),
        (args.tls_key, security.ENV_KEY),
        (args.tls_ca, security.ENV_CA),
        (args.tokens_file, security.ENV_TOKENS_FILE),
        (args.mesh_secret_file, security.ENV_MESH_SECRET_FILE),
    ):
        if flag:
            env[name] = str(Path(flag).resolve())
    if args.tls_mutual:
        env[security.ENV_MUTUAL] = "1"
    return env


def mesh_argv(args: argparse.Namespace) -> list[str]:
    """The same flags again, for `up --detach`'s child."""
    argv: list[str] = []
    if args.tls:
        argv += ["--tls", args.tls]
    for flag, value in (
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--tls-ca", args.tls_ca),
        ("--tokens-file", args.tokens_file),
        ("--mesh-secret-file", args.mesh_secret_file),
    ):
        if value:
            argv += [flag, str(Path(value).resolve())]
    if args.tls_mutual:
        argv.append("--tls-mutual")
    return argv


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security")
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="TLS, checked against this CA bundle (default: $OMNIRAIL_TLS_CA; else plaintext)",
    )
    g.add_argument("--tls", action="store_true", help="TLS, checked against the system's roots")
    g.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="bearer token (its first line; default: $OMNIRAIL_TOKEN)",
    )
    g.add_argument("--server-name", default=None, help="name the server certificate must have")


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Client` keyword arguments from the client flags."""
    tls: bool | str | None = args.tls_ca or (True if args.tls else None)
    token = None  # None: the SDK falls back to $OMNIRAIL_TOKEN
    if args.token_file:
        # grpc: only when used
        from omnirail.transport.security import SecurityError, secret_lines, token_entry

        try:
            lines = secret_lines(Path(args.token_file).read_bytes())
        except OSError as exc:
            raise ValueError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not lines:
            raise ValueError(f"--token-file {args.token_file}: no token in it")
        try:  # a line of a mesh's tokens file may name its principal after a comma
            token = token_entry(lines[0], f"--token-file {args.token_file}")[0].decode()
        except (SecurityError, UnicodeDecodeError) as exc:
            raise ValueError(str(exc)) from None
    return {
        "tls": tls,
        "token": token,
        "server_name": args.server_name,
    }
