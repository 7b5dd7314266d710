"""omnirail/models/qwen3_omni in containers: `omnirail compose MODEL_DIR` (a tiny random
checkpoint made here; nothing is downloaded), brought up with podman
and docker-compose from the real image. Each model stage reads the checkpoint from its
read-only /model bind; the mesh answers a text request with the reference generate()'s
tokens, streaming text and audio."""

from __future__ import annotations

import os
import random
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from omnirail import Chunk, Client
from tests.e2e import compose_env
from tests.e2e.compose_env import Project, http_json, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PORT = 50071
HTTP_PORT = 8071
MAX_NEW_TOKENS = 8
TALKER_TOKENS = 12
TOKEN = "e2e-" + secrets.token_hex(16)
CLIENT: dict[str, Any] = {"token": TOKEN}  # and "tls": the CA, once made
MODEL_STAGES = ("image-encoder", "audio-encoder", "thinker", "talker", "code2wav")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnirail.testing.tiny import qwen3_omni as tiny_model

    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("qwen3_omni_e2e") / "tiny")


@pytest.fixture(scope="module")
def project(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    reason = compose_env.why_unavailable()
    if reason:
        pytest.skip(reason)
    env = compose_env.prepare()
    where = tmp_path_factory.mktemp("qwen3_omni_compose")
    out = where / "docker-compose.yml"
    # Secured: TLS on every hop (mutual inside), a mesh secret, a client token.
    tokens = where / "tokens"
    tokens.write_text(TOKEN + "\n")
    os.chown(tokens, -1, 10001)  # the image's group may read it, nobody else
    tokens.chmod(0o640)
    # From the checkpoint directory, as a user deploys it: the installed pipeline, its
    # token limits set on the command line.
    command = [
        str(Path(sys.executable).parent / "omnirail"), "compose", str(model), "-o", str(out),
        "--set", f"stages.preprocessing.factory_args.max_new_tokens={MAX_NEW_TOKENS}",
        "--set", f"stages.talker.factory_args.max_new_tokens={TALKER_TOKENS}",
        "--coordinator-port", str(PORT), "--http-port", str(HTTP_PORT), "--build-context", "none",
        "--tls", str(where / "tls"), "--tokens-file", str(tokens),
    ]  # fmt: skip
    # save_pretrained writes the shards 0600: compose refuses what the image's user could
    # not read, naming the file and the fix, rather than the stages failing once started.
    refused = subprocess.run(command, capture_output=True, text=True, cwd=compose_env.ROOT)
    assert refused.returncode == 2
    assert "is not readable by the image's user (uid 10001)" in refused.stderr
    assert f"chmod -R a+rX {model}" in refused.stderr
    subprocess.run(["chmod", "-R", "a+rX", str(model)], check=True)
    subprocess.run(command, check=True, capture_output=True, text=True, cwd=compose_env.ROOT)
    proj = Project(f"omnirail-e2e-qwen3-{random.getrandbits(24):06x}", env, out)
    CLIENT["tls"] = str(where / "tls" / "ca.pem")
    with compose_env.running(proj, f"localhost:{PORT}", ready_timeout=600, **CLIENT):
        yield proj


def _stream(request: dict[str, Any]) -> tuple[dict[str, list], Any]:
    chunks: dict[str, list] = {}
    with Client(f"localhost:{PORT}", timeout=300, tensors="numpy", **CLIENT) as client:
        for event in client.stream(request):
            if isinstance(event, Chunk):
                chunks.setdefault(event.modality, []).append(event.data)
            else:
                return chunks, event
    raise AssertionError("the stream ended without a result")


def test_text_request_equals_generate_in_containers(project: Project, model: Path) -> None:
    from omnirail.models.qwen3_omni.processor import load_processor
    from omnirail.testing.tiny import qwen3_omni as tiny_model

    reference = tiny_model.load_reference(model)
    processor = load_processor(model)
    conversation = tiny_model.sample_conversation("text", "Describe this.")
    prompt = tiny_model.processor_inputs(processor, conversation)["input_ids"].shape[1]
    sequences, wav = tiny_model.reference_generate(
        reference,
        processor,
        conversation,
        thinker_max_new_tokens=MAX_NEW_TOKENS,
        talker_max_new_tokens=TALKER_TOKENS,
    )
    chunks, result = _stream({"text": "Describe this.", "max_new_tokens": MAX_NEW_TOKENS})
    assert result.outputs["decode"]["token_ids"] == sequences[0, prompt:].tolist()
    assert "".join(chunks["text"]) == result.outputs["decode"]["text"]
    pcm = np.concatenate([np.asarray(c["pcm"]) for c in chunks["audio"]])
    assert pcm.size == result.outputs["code2wav"]["samples"] == wav.numel()
    assert np.abs(pcm - wav.reshape(-1).numpy()).max() < 1e-5


def test_model_stages_read_the_model_read_only(project: Project, model: Path) -> None:
    """Every model stage's container has the checkpoint at /model, read-only; the
    coordinator's has none."""
    names = project.containers()
    for stage in MODEL_STAGES:
        (name,) = [n for n in names if re.search(rf"[_-]{stage}[_-]\d+$", n)]
        config = yaml.safe_load(project.podman("exec", name, "cat", "/model/config.json"))
        assert config["model_type"] == "qwen3_omni_moe"
        with pytest.raises(compose_env.SetupError, match="Read-only"):
            project.podman("exec", name, "touch", "/model/written")
    (coordinator,) = [n for n in names if re.search(r"[_-]coordinator[_-]\d+$", n)]
    with pytest.raises(compose_env.SetupError):
        project.podman("exec", coordinator, "ls", "/model")


def test_the_secured_deployment_refuses_strangers(project: Project) -> None:
    """Without the token, or without TLS, the published port refuses; the containers'
    own health checks speak TLS (podman reports them healthy)."""
    from omnirail import OmniError
    from omnirail.wire.errors import Code

    for options, code in (
        ({"tls": CLIENT["tls"]}, Code.UNAUTHENTICATED),
        ({"tls": CLIENT["tls"], "token": "wrong"}, Code.UNAUTHENTICATED),
        ({"tls": False, "token": TOKEN}, Code.UNAVAILABLE),
    ):
        with Client(f"localhost:{PORT}", timeout=30, **options) as client:
            with pytest.raises(OmniError) as info:
                client.describe()
            assert info.value.code == code, (options, info.value)
    names = project.containers()
    (coordinator,) = [n for n in names if re.search(r"[_-]coordinator[_-]\d+$", n)]
    project.podman("healthcheck", "run", coordinator)  # raises unless healthy


def test_the_secured_gateway_needs_https_and_the_token(project: Project) -> None:
    """The gateway container serves HTTPS with the deployment's certificate and takes the
    same client tokens as the gRPC API; its health check (over HTTPS) passes."""
    import ssl
    import time

    import httpx2

    trust = ssl.create_default_context(cafile=CLIENT["tls"])
    url = f"https://localhost:{HTTP_PORT}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx2.get(f"{url}/health", verify=trust, timeout=5).status_code == 200:
                break
        except httpx2.HTTPError:
            pass
        assert time.monotonic() < deadline, project.logs()[-4000:]
        time.sleep(1)
    body = {"model": "qwen3-omni", "messages": [{"role": "user", "content": "Hello"}]}
    chat = f"{url}/v1/chat/completions"
    refused = httpx2.post(chat, json=body, verify=trust, timeout=60)
    assert refused.status_code == 401, refused.text
    served = httpx2.post(
        chat, json=body, verify=trust, timeout=300, headers={"authorization": f"Bearer {TOKEN}"}
    )
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["content"]
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(f"http://localhost:{HTTP_PORT}/health", timeout=5).raise_for_status()
    (gateway,) = [n for n in project.containers() if "gateway" in n]
    project.podman("healthcheck", "run", gateway)  # raises unless healthy


def test_prometheus_scrapes_every_service_over_https(project: Project) -> None:
    """Every /metrics serves HTTPS and asks for a certificate from the mesh CA; Prometheus,
    given the material and the image's group to read its key, scrapes every service."""
    services = yaml.safe_load(project.file.read_text())["services"]
    want = {n for n in services if n not in ("jaeger", "prometheus", "gateway")}

    def all_up() -> list[dict[str, Any]] | None:
        targets = http_json("http://localhost:9090/api/v1/targets")["data"]["activeTargets"]
        up = {t["labels"].get("service") for t in targets if t["health"] == "up"}
        return targets if want <= up else None

    targets = wait_for(all_up, 120, "every service up in Prometheus, over HTTPS")
    assert all(t["scrapeUrl"].startswith("https://") for t in targets), targets
