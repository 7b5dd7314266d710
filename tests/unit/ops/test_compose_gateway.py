"""`omnirail compose` plans the OpenAI gateway for pipelines with `api.openai`: a service
after the coordinator, published on --http-port, its health check on its /health, and
with --tls the same material plus the client tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnirail.ops.compose_tls import IMAGE_GID, TLS_MOUNT, TOKENS_MOUNT
from omnirail.ops.health import ADDRESS_ENV
from tests.unit.ops.compose_helpers import QUICKSTART, REPO, flag, gen, services

OMNI_DEMO = REPO / "examples/omni_demo/pipeline.yaml"


def test_a_pipeline_with_api_openai_gets_a_gateway_after_the_coordinator(tmp_path: Path) -> None:
    svc = services(gen(OMNI_DEMO, tmp_path / "docker-compose.yml"))
    assert list(svc)[:2] == ["coordinator", "gateway"]
    gateway = svc["gateway"]
    command = gateway["command"]
    assert command[0] == "gateway"
    assert flag(command, "--coordinator") == "coordinator:50051"
    assert flag(command, "--listen") == "0.0.0.0:8000"
    assert gateway["ports"] == ["8000:8000"]
    assert gateway["environment"][ADDRESS_ENV] == "http://localhost:8000/health"
    assert gateway["environment"]["OTEL_SERVICE_NAME"] == "omnirail-gateway"
    assert gateway["depends_on"] == {"coordinator": {"condition": "service_started"}}
    assert gateway["stop_grace_period"] == svc["coordinator"]["stop_grace_period"]


def test_http_port_moves_or_drops_it(tmp_path: Path) -> None:
    moved = gen(OMNI_DEMO, tmp_path / "a.yml", http_port=8071)
    assert services(moved)["gateway"]["ports"] == ["8071:8000"]
    assert "--http-port 8071" in moved.text.splitlines()[2]
    assert "gateway" not in services(gen(OMNI_DEMO, tmp_path / "b.yml", http_port=0))


def test_a_pipeline_without_api_openai_gets_none(tmp_path: Path) -> None:
    assert "gateway" not in services(gen(QUICKSTART, tmp_path / "docker-compose.yml"))


@pytest.mark.skipif(os.geteuid() != 0, reason="chgrp to the image's group")
def test_with_tls_the_gateway_speaks_https_and_takes_the_tokens(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-1\n")
    os.chown(tokens, -1, IMAGE_GID)
    tokens.chmod(0o640)
    bundle = gen(OMNI_DEMO, tmp_path / "c.yml", tls_dir=tmp_path / "tls", tokens_file=tokens)
    gateway = services(bundle)["gateway"]
    env = gateway["environment"]
    assert env[ADDRESS_ENV] == "https://localhost:8000/health"
    assert env["OMNIRAIL_TLS_CERT"] == f"{TLS_MOUNT}/mesh.pem"
    assert env["OMNIRAIL_TOKENS_FILE"] == TOKENS_MOUNT
    assert TOKENS_MOUNT in {v["target"] for v in gateway["volumes"]}
    assert "gateway" in bundle.tls_hosts
