"""The top-level docker-compose.yml, brought up for real with podman and docker-compose.

Nothing can be pulled here, so the Jaeger and Prometheus images are local stand-ins tagged
under the names the compose file uses (scripts/container/standin_images.sh): Prometheus is
Debian's, laid out like the official image; "Jaeger" is an OTLP receiver serving Jaeger's
query API. Everything else is the real image and the committed compose file, unchanged.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from omnirail import Chunk, Client, OmniError
from omnirail.wire.errors import Code
from tests.e2e import compose_env
from tests.e2e.compose_env import Project, http_json, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ADDRESS = "localhost:50051"
STAGES = [
    "preprocessing", "image-encoder", "audio-encoder", "mm-aggregate",
    "thinker", "decode", "talker", "code2wav",
]  # fmt: skip
SERVICES = ["coordinator", *STAGES]


@pytest.fixture(scope="module")
def project() -> Iterator[Project]:
    reason = compose_env.why_unavailable()
    if reason:
        pytest.skip(reason)
    env = compose_env.prepare()
    shm_before = set(os.listdir("/dev/shm"))
    proj = Project(
        f"omnirail-e2e-{random.getrandbits(24):06x}", env, compose_env.ROOT / "docker-compose.yml"
    )
    try:
        with compose_env.running(proj, ADDRESS):
            yield proj
    finally:
        # The pools lived in the containers' IPC namespaces; nothing may land on the host.
        left = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("omnirail")}
        assert not left, f"shared memory left on the host: {sorted(left)}"


def _stream(client: Client, inputs: dict[str, Any], **kw: Any) -> tuple[dict[str, list], Any]:
    chunks: dict[str, list[Chunk]] = {}
    for event in client.stream(inputs, **kw):
        if isinstance(event, Chunk):
            chunks.setdefault(event.modality, []).append(event)
        else:
            return chunks, event
    raise AssertionError("no result")


def _check(chunks: dict[str, list], outputs: dict[str, Any]) -> None:
    assert "".join(c.data for c in chunks["text"]) == outputs["decode"]["text"]
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in chunks["audio"]])
    assert pcm.size == outputs["code2wav"]["samples"] == outputs["decode"]["tokens"] * 4 * 320


def test_text_and_multimodal_requests_stream_and_are_traced(project: Project) -> None:
    trace_id = f"{random.getrandbits(128):032x}"
    parent = f"00-{trace_id}-{random.getrandbits(64):016x}-01"
    image = (np.arange(64 * 64 * 3) % 251).astype(np.uint8).reshape(64, 64, 3)
    audio = (0.2 * np.sin(np.arange(16000) / 7.0)).astype(np.float32)
    with Client(ADDRESS, timeout=120, tensors="numpy") as client:
        chunks, text_only = _stream(client, {"text": "hello from compose", "seed": 1})
        _check(chunks, text_only.outputs)
        mm = {"text": "what is this", "image": image, "audio": audio, "seed": 1}
        chunks, result = _stream(client, mm, traceparent=parent)
        _check(chunks, result.outputs)
    assert result.outputs["decode"]["text"] != text_only.outputs["decode"]["text"]

    # Every service's spans reach Jaeger, in the caller's trace.
    def trace_services() -> set[str] | None:
        data = http_json(f"http://localhost:16686/api/traces/{trace_id}")["data"]
        if not data:
            return None
        names = {p["serviceName"] for p in data[0]["processes"].values()}
        return names if {f"omnirail-{s}" for s in SERVICES} <= names else None

    wait_for(trace_services, 60, "spans from every service in the request's trace")

    # nixl and ucx moved the bytes of the cross-container edges; shm those inside a group.
    def moved() -> dict[str, float] | None:
        query = urllib.parse.quote('sum by (backend) (omnirail_relay_bytes_total{op="get"})')
        rows = http_json(f"http://localhost:9090/api/v1/query?query={query}")["data"]["result"]
        by = {r["metric"].get("backend", ""): float(r["value"][1]) for r in rows}
        return by if all(by.get(b, 0) > 0 for b in ("nixl", "ucx", "shm")) else None

    wait_for(moved, 60, "relay bytes over nixl, ucx and shm in Prometheus")


def test_prometheus_scrapes_every_service(project: Project) -> None:
    def all_up() -> bool:
        targets = http_json("http://localhost:9090/api/v1/targets")["data"]["activeTargets"]
        up = {t["labels"].get("service") for t in targets if t["health"] == "up"}
        return set(SERVICES) <= up

    wait_for(all_up, 90, "every service up in Prometheus")


def test_abort_mid_stream(project: Project) -> None:
    with Client(ADDRESS, timeout=120, tensors="numpy") as client:
        events = client.stream({"text": "long", "max_new_tokens": 256}, request_id="e2e-abort")
        for event in events:
            if isinstance(event, Chunk) and event.modality == "audio":
                break
        acked = client.abort("e2e-abort", "e2e")
        with pytest.raises(OmniError) as info:
            for _ in events:
                pass
        assert info.value.code == Code.CANCELLED
        # Every stage was told; containers on a busy host may ack past abort_ack_timeout_s
        # (0.5 s), and are then named as not acknowledged rather than waited for.
        told = acked.acknowledged + acked.not_acknowledged
        assert {"thinker", "talker", "code2wav"} <= {a.split("/")[0] for a in told}
        assert client.status("e2e-abort").state == "aborted"
        chunks, result = _stream(client, {"text": "after abort", "max_new_tokens": 5})
    _check(chunks, result.outputs)


def test_killed_stage_container_fails_its_requests_and_recovers(project: Project) -> None:
    """Long requests in flight when the talker's container dies end with UNAVAILABLE; a
    text-only request (no talker on its path) is still served; then the talker comes back."""
    with Client(ADDRESS, timeout=120, tensors="numpy") as client:
        outcomes: dict[str, Any] = {}
        started = threading.Barrier(5)

        def doomed(rid: str) -> None:
            events = client.stream({"text": rid, "max_new_tokens": 256}, request_id=rid)
            try:
                for event in events:
                    if (
                        isinstance(event, Chunk)
                        and event.modality == "audio"
                        and rid not in outcomes
                    ):
                        outcomes[rid] = "streaming"
                        started.wait(60)
                outcomes[rid] = "completed"
            except OmniError as exc:
                outcomes[rid] = exc

        rids = [f"e2e-kill-{i}" for i in range(4)]
        threads = [threading.Thread(target=doomed, args=(rid,)) for rid in rids]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has audio: the talker is busy with all four
        t0 = time.monotonic()
        project.podman("kill", f"{project.name}_talker_1")
        for t in threads:
            t.join(60)
        print(f"streams ended {time.monotonic() - t0:.2f} s after the kill: {outcomes}")
        assert all(isinstance(outcomes[r], OmniError) for r in rids), outcomes
        assert {outcomes[r].code for r in rids} == {Code.UNAVAILABLE}, outcomes
        status = client.status(rids[0])
        assert status.state == "failed" and status.error is not None
        assert status.error.code == Code.UNAVAILABLE

        # Text only: the talker is on no path to the request's terminal stages.
        quiet = client.generate({"text": "still talking", "speak": False, "max_new_tokens": 4})
        assert quiet.outputs["decode"]["tokens"] == 4
        with pytest.raises(OmniError) as info:
            client.generate({"text": "needs a voice", "max_new_tokens": 4}, timeout=30)
        assert info.value.code == Code.UNAVAILABLE

        project.compose("start", "talker")
        client.wait_ready(timeout=180)

        def served() -> bool:
            chunks, result = _stream(client, {"text": "back again", "max_new_tokens": 5})
            _check(chunks, result.outputs)
            return True

        try:
            wait_for(served, 120, "a request served after the talker came back", interval=1.0)
        except BaseException:
            print(project.logs())
            raise


def test_shm_edges_share_one_ipc_namespace(project: Project) -> None:
    """The encoders' group sees preprocessing's shm pool (the multimodal request above used
    it); the thinker's group, on nixl from mm_aggregate, has its own /dev/shm."""
    encoders = project.podman("exec", f"{project.name}_audio-encoder_1", "ls", "/dev/shm")
    assert any(n.startswith("omnirail-preprocessing") for n in encoders.split()), encoders
    thinker = project.podman("exec", f"{project.name}_thinker_1", "ls", "/dev/shm")
    assert not any(n.startswith("omnirail-preprocessing") for n in thinker.split()), thinker


def test_a_stage_whose_process_dies_is_restarted_by_its_policy(project: Project) -> None:
    """The generated file gives stages `restart: on-failure:N`: a stage process that dies
    (not a container stopped on purpose) comes back by itself and serves again."""
    container = f"{project.name}_talker_1"
    policy = project.podman("inspect", "-f", "{{.HostConfig.RestartPolicy.Name}}", container)
    assert policy.strip() == "on-failure", policy
    pid = int(project.podman("inspect", "-f", "{{.State.Pid}}", container).strip())
    os.kill(pid, signal.SIGKILL)  # the stage process itself, from the host
    with Client(ADDRESS, timeout=120, tensors="numpy") as client:

        def served() -> bool:
            chunks, result = _stream(client, {"text": "back by itself", "max_new_tokens": 5})
            _check(chunks, result.outputs)
            return True

        try:
            wait_for(served, 180, "a request served after the talker restarted", interval=1.0)
        except BaseException:
            print(project.logs())
            raise
    restarts = project.podman("inspect", "-f", "{{.RestartCount}}", container).strip()
    assert int(restarts) >= 1, restarts


def _gateway_ready(project: Project, url: str, timeout: float = 180.0, **tls: Any) -> None:
    import httpx2

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx2.get(f"{url}/health", timeout=5, **tls).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        assert time.monotonic() < deadline, project.logs()[-4000:]
        time.sleep(1)


def test_the_openai_gateway_container_serves_chat_with_audio(project: Project) -> None:
    """The compose file's gateway service: the openai SDK streams a chat completion with
    audio from the published port, equal to the native API's answer; its container's
    health check (the image's `omnirail health`, on the gateway's /health) passes."""
    import base64

    openai = pytest.importorskip("openai")
    _gateway_ready(project, "http://localhost:8000")
    inputs = {"text": "a river in the mountains", "max_new_tokens": 6}
    with Client(ADDRESS, timeout=120, tensors="numpy") as client:
        chunks, result = _stream(client, inputs)
    oai = openai.OpenAI(base_url="http://localhost:8000/v1", api_key="-", max_retries=0)
    text, audio = [], bytearray()
    for chunk in oai.chat.completions.create(
        model="omni-demo",
        messages=[{"role": "user", "content": inputs["text"]}],
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "pcm16"},
        max_tokens=6,
        stream=True,
    ):
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        extra = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
        if extra:
            audio += base64.b64decode(extra["data"] if isinstance(extra, dict) else extra.data)
    assert "".join(text) == result.outputs["decode"]["text"]
    pcm = np.concatenate([np.asarray(c.data["pcm"]) for c in chunks["audio"]])
    want = np.rint(np.clip(pcm, -1, 1) * 32767).astype(np.int16)
    np.testing.assert_array_equal(np.frombuffer(bytes(audio), "<i2"), want)
    (gateway,) = [n for n in project.containers() if "gateway" in n]
    project.podman("healthcheck", "run", gateway)  # raises unless healthy
