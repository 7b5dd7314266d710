"""`omnirail compose --tls DIR [--tokens-file FILE]`: a compose deployment secured like
`omnirail up --tls auto`.

DIR holds the mesh's material (ops/certs.py); when it holds none, a fresh set is made whose
certificate names every service (the hosts peers dial inside the compose network) and
localhost (health checks, the published port). It is bind-mounted read-only at
/etc/omnirail/tls into every omnirail service, which read it through OMNIRAIL_TLS_*; the
tokens file is mounted into the coordinator and the gateway alone. Prometheus gets the
material too: every /metrics endpoint then serves HTTPS and asks for the mesh's
certificate. The image runs as uid/gid 10001, and a bind mount shows the host's owners and
modes: the key and the secret are made readable by group 10001 (which takes root here;
Prometheus joins that group); otherwise the command says what to run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omnirail.config import security
from omnirail.ops.compose_groups import ComposeError

TLS_MOUNT = "/etc/omnirail/tls"
# The material's files (ops/certs.py's names) as every container sees them.
CA_PATH = f"{TLS_MOUNT}/ca.pem"
CERT_PATH = f"{TLS_MOUNT}/mesh.pem"
KEY_PATH = f"{TLS_MOUNT}/mesh.key"
SECRET_PATH = f"{TLS_MOUNT}/mesh-secret"
TOKENS_MOUNT = "/etc/omnirail/tokens"
IMAGE_GID = 10001  # the Dockerfile's USER


def ensure_material(folder: Path, hosts: Iterable[str]) -> list[str]:
    """Makes the material in `folder` unless it is all there (then checks that its
    certificate names `hosts`). Returns warnings for the user."""
    from cryptography import x509

    from omnirail.ops.certs import CERT_FILE, MATERIAL, make_mesh_material

    hosts = list(hosts)
    present = [name for name in MATERIAL if (folder / name).exists()]
    if len(present) == len(MATERIAL):
        cert = x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
            named = set(san.value.get_values_for_type(x509.DNSName))
        except x509.ExtensionNotFound:
            named = set()
        missing = sorted(set(hosts) - named)
        if missing:
            raise ComposeError(
                f"--tls {folder}: {CERT_FILE} does not name {missing}; remove the folder's "
                "files to have a new set made for this deployment"
            )
        return []
    if present:
        raise ComposeError(
            f"--tls {folder}: holds {present} but not {sorted(set(MATERIAL) - set(present))};"
            " give a complete set or an empty folder"
        )
    try:
        make_mesh_material(folder, hosts, reader_gid=IMAGE_GID)
        return []
    except PermissionError:
        make_mesh_material(folder, hosts)
        return [
            f"the image's user ({IMAGE_GID}) cannot read the key and secret in {folder}: run "
            f"`chgrp -R {IMAGE_GID} {folder} && chmod g+rX -R {folder}` as root"
        ]


def secure(
    services: dict[str, dict[str, Any]],
    omnirail_services: Iterable[str],
    tls_source: str,
    tokens_source: str | None,
) -> None:
    """Mounts the material into every omnirail service and points OMNIRAIL_TLS_* at it."""
    env = material_env()
    for name in omnirail_services:
        service = services[name]
        service["environment"].update(env)
        service["volumes"].append(_bind(tls_source, TLS_MOUNT))
    if "prometheus" in services:
        # It scrapes every /metrics over HTTPS, showing the mesh's certificate: its user
        # (nobody) reads the key through the group the material is made readable by.
        prometheus = services["prometheus"]
        prometheus.setdefault("volumes", []).append(_bind(tls_source, TLS_MOUNT))
        prometheus["group_add"] = [str(IMAGE_GID)]
    if tokens_source is not None:
        # The coordinator checks clients' tokens; the gateway checks its callers' and shows
        # the file's first token to the coordinator.
        for name in ("coordinator", "gateway"):
            if name in services:
                services[name]["environment"][security.ENV_TOKENS_FILE] = TOKENS_MOUNT
                services[name]["volumes"].append(_bind(tokens_source, TOKENS_MOUNT))


def material_env() -> dict[str, str]:
    """What points a container's omnirail process at the mounted material (mutual TLS and
    the mesh secret), for compose and k8s alike."""
    return {
        security.ENV_CERT: CERT_PATH,
        security.ENV_KEY: KEY_PATH,
        security.ENV_CA: CA_PATH,
        security.ENV_MUTUAL: "1",
        security.ENV_MESH_SECRET_FILE: SECRET_PATH,
    }


def prometheus_tls() -> dict[str, str]:
    """Prometheus's `tls_config` for scraping the mesh's /metrics (the material mounted)."""
    return {"ca_file": CA_PATH, "cert_file": CERT_PATH, "key_file": KEY_PATH}


def check_tokens_file(path: Path) -> None:
    from omnirail.transport.security import secret_lines  # the tokens files' one format

    if not path.is_file():
        raise ComposeError(f"--tokens-file {path}: not a file")
    if not secret_lines(path.read_bytes()):
        raise ComposeError(f"--tokens-file {path}: no token in it")
    st = os.stat(path)
    if st.st_mode & 0o004:
        raise ComposeError(f"--tokens-file {path}: readable by every user; chmod o-r it")
    if not (st.st_uid == IMAGE_GID and st.st_mode & 0o400) and not (
        st.st_gid == IMAGE_GID and st.st_mode & 0o040
    ):
        raise ComposeError(
            f"--tokens-file {path}: the image's user ({IMAGE_GID}) cannot read it; "
            f"`chgrp {IMAGE_GID} {path} && chmod 640 {path}`"
        )


def _bind(source: str, target: str) -> dict[str, Any]:
    return {"type": "bind", "source": source, "target": target, "read_only": True}
