"""`omnirail compose --tls DIR --tokens-file FILE`: material made or reused, mounted into
every omnirail service, the token into the coordinator alone, Prometheus scraping over HTTPS,
and bad requests refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from omnirail.ops.compose import ComposeError, write_bundle
from omnirail.ops.compose_tls import IMAGE_GID, TLS_MOUNT, TOKENS_MOUNT
from tests.unit.ops.compose_helpers import QUICKSTART, gen, services, side_file


@pytest.fixture
def pipeline(tmp_path: Path) -> Path:
    shutil.copytree(
        QUICKSTART.parent, tmp_path / "qs", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path / "qs" / "pipeline.yaml"


def _tokens(tmp_path: Path, mode: int = 0o640, group: int | None = IMAGE_GID) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# clients\ntok-1\n")
    if group is not None:
        os.chown(path, -1, group)
    path.chmod(mode)
    return path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chgrp to the image's group")


@needs_root
def test_every_omnirail_service_gets_the_material_and_the_coordinator_the_tokens(
    pipeline: Path, tmp_path: Path
) -> None:
    tls = tmp_path / "tls"
    out = tmp_path / "docker-compose.yml"
    bundle = gen(pipeline, out, tls_dir=tls, tokens_file=_tokens(tmp_path))
    omnirail = [n for n in services(bundle) if n not in ("jaeger", "prometheus")]
    assert len(omnirail) == 5
    for name in omnirail:
        service = services(bundle)[name]
        env = service["environment"]
        assert env["OMNIRAIL_TLS_CERT"] == f"{TLS_MOUNT}/mesh.pem"
        assert env["OMNIRAIL_TLS_MUTUAL"] == "1"
        assert env["OMNIRAIL_MESH_SECRET_FILE"] == f"{TLS_MOUNT}/mesh-secret"
        binds = {v["target"]: v for v in service["volumes"]}
        assert binds[TLS_MOUNT]["source"] == "./tls" and binds[TLS_MOUNT]["read_only"]
        has_tokens = TOKENS_MOUNT in binds
        assert has_tokens == (name == "coordinator")
        assert ("OMNIRAIL_TOKENS_FILE" in env) == (name == "coordinator")
    assert "--tls tls --tokens-file tokens" in bundle.text.splitlines()[2]
    assert not tls.exists()  # generate() writes nothing
    write_bundle(bundle)
    key = tls / "mesh.key"
    assert key.stat().st_gid == IMAGE_GID and key.stat().st_mode & 0o777 == 0o640
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tls / "mesh.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert set(names.value.get_values_for_type(x509.DNSName)) >= set(omnirail) | {"localhost"}
    # A second run reuses the material: the mesh keeps its CA.
    before = (tls / "ca.pem").read_bytes()
    write_bundle(gen(pipeline, out, tls_dir=tls))
    assert (tls / "ca.pem").read_bytes() == before


def test_material_that_is_incomplete_or_names_other_hosts_is_refused(
    pipeline: Path, tmp_path: Path
) -> None:
    from omnirail.ops.certs import make_mesh_material

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "ca.pem").write_text("x")
    with pytest.raises(ComposeError, match=r"holds \['ca.pem'\] but not"):
        write_bundle(gen(pipeline, None, tls_dir=partial))
    other = tmp_path / "other"
    make_mesh_material(other, ["coordinator"])
    with pytest.raises(ComposeError, match=r"mesh\.pem does not name"):
        write_bundle(gen(pipeline, None, tls_dir=other))


def test_tokens_need_tls_and_a_file_only_the_image_may_read(pipeline: Path, tmp_path: Path) -> None:
    with pytest.raises(ComposeError, match="--tokens-file needs --tls"):
        gen(pipeline, None, tokens_file=_tokens(tmp_path, group=None))
    with pytest.raises(ComposeError, match="readable by every user"):
        gen(pipeline, None, tls_dir=tmp_path / "t", tokens_file=_tokens(tmp_path, 0o644, None))
    if os.geteuid() == 0:
        with pytest.raises(ComposeError, match=r"image's user \(10001\) cannot read it"):
            gen(pipeline, None, tls_dir=tmp_path / "t", tokens_file=_tokens(tmp_path, 0o600, None))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ComposeError, match="no token in it"):
        gen(pipeline, None, tls_dir=tmp_path / "t", tokens_file=empty)


def test_prometheus_scrapes_over_https_showing_the_mesh_certificate(
    pipeline: Path, tmp_path: Path
) -> None:
    bundle = gen(pipeline, tmp_path / "docker-compose.yml", tls_dir=tmp_path / "tls")
    prometheus = services(bundle)["prometheus"]
    binds = {v["target"]: v for v in prometheus["volumes"]}
    assert binds[TLS_MOUNT]["source"] == "./tls" and binds[TLS_MOUNT]["read_only"]
    # Its user (nobody) reads the group-readable key through the image's group.
    assert prometheus["group_add"] == [str(IMAGE_GID)]
    _, text = side_file(bundle, ".prometheus.yml")
    [job] = yaml.safe_load(text)["scrape_configs"]
    assert job["scheme"] == "https"
    assert job["tls_config"] == {
        "ca_file": f"{TLS_MOUNT}/ca.pem",
        "cert_file": f"{TLS_MOUNT}/mesh.pem",
        "key_file": f"{TLS_MOUNT}/mesh.key",
    }
    # The targets are service names, which the mesh certificate names.
    assert [t.split(":")[0] for sc in job["static_configs"] for t in sc["targets"]] == [
        n for n in services(bundle) if n not in ("jaeger", "prometheus")
    ]
    # Without --tls: plain HTTP, no material.
    plain = gen(pipeline, tmp_path / "plain.yml")
    _, text = side_file(plain, ".prometheus.yml")
    [job] = yaml.safe_load(text)["scrape_configs"]
    assert "scheme" not in job and "tls_config" not in job
    assert "group_add" not in services(plain)["prometheus"]
