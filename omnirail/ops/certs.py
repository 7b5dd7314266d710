"""Throwaway security material for a local or compose mesh (`--tls auto`, `compose --tls`).

`make_mesh_material(folder, hosts)` writes:
- ``ca.pem``: a CA made for this mesh alone. Its key is never written: nothing else can be
  signed by it, so leaking the folder later cannot mint new members.
- ``mesh.pem`` / ``mesh.key``: one certificate every service of the mesh presents, valid
  for `hosts` (and localhost), usable as server and client certificate (mutual TLS).
- ``mesh-secret``: the membership secret stages show when they Attach and Deliver.
Keys and the secret are mode 0600. ECDSA P-256: fast handshakes, small certificates.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from omnirail.config import security

CA_FILE = "ca.pem"
CERT_FILE = "mesh.pem"
KEY_FILE = "mesh.key"
SECRET_FILE = "mesh-secret"
MATERIAL = (CA_FILE, CERT_FILE, KEY_FILE, SECRET_FILE)
_VALID_DAYS = 30


def _name(common: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "omnirail"),
            x509.NameAttribute(NameOID.COMMON_NAME, common),
        ]
    )


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in ["localhost", "127.0.0.1", "::1", *hosts]:
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write(path: Path, data: bytes, private: bool, gid: int | None) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    mode = (0o640 if gid is not None else 0o600) if private else 0o644
    fd = os.open(path, flags, mode)
    with os.fdopen(fd, "wb") as f:
        if gid is not None:
            os.fchown(f.fileno(), -1, gid)
        os.fchmod(f.fileno(), mode)  # also when the file was there before
        f.write(data)


def make_mesh_material(
    folder: str | Path, hosts: Iterable[str] = (), reader_gid: int | None = None
) -> dict[str, Path]:
    """Writes a fresh CA, mesh certificate and key, and mesh secret into `folder`.

    `reader_gid`: the group that may also read the key and the secret (a container's user,
    which a bind mount shows the host's owners and modes); only the owner otherwise.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    if reader_gid is not None:
        os.chown(out, -1, reader_gid)
        out.chmod(0o750)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=_VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"omnirail mesh CA {secrets.token_hex(4)}")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("omnirail mesh"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(hosts), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = {name: out / name for name in MATERIAL}
    _write(paths[CA_FILE], ca.public_bytes(pem), private=False, gid=reader_gid)
    _write(paths[CERT_FILE], cert.public_bytes(pem), private=False, gid=reader_gid)
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(paths[KEY_FILE], key_pem, private=True, gid=reader_gid)
    secret = secrets.token_urlsafe(32).encode() + b"\n"
    _write(paths[SECRET_FILE], secret, private=True, gid=reader_gid)
    return paths


def material_env(paths: dict[str, Path], mutual: bool = True) -> dict[str, str]:
    """The environment that hands `paths` to every process of a mesh."""
    return {
        security.ENV_CERT: str(paths[CERT_FILE]),
        security.ENV_KEY: str(paths[KEY_FILE]),
        security.ENV_CA: str(paths[CA_FILE]),
        security.ENV_MUTUAL: "1" if mutual else "0",
        security.ENV_MESH_SECRET_FILE: str(paths[SECRET_FILE]),
    }
