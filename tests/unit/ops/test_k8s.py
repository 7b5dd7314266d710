"""`omnirail k8s`: manifests for the example pipelines, every object validated against the
Kubernetes schemas (kubernetes-validate, the version in omnirail.ops.k8s), and the wiring
schemas cannot see: Services select pods that exist and name ports they serve, probes name
served ports, processes joined by shm edges share a pod, GPU limits match the config."""

from __future__ import annotations

import base64
import re
import secrets
import shlex
from pathlib import Path
from typing import Any

import pytest

from omnirail.config import load_pipeline
from omnirail.ops.compose_groups import ComposeError, shm_edges
from omnirail.ops.k8s import KUBERNETES_VERSION, K8sBundle, K8sOptions, generate, write_bundle
from tests.unit.ops.compose_helpers import QUICKSTART, QWEN3_OMNI, REPO, STREAMING

kubernetes_validate = pytest.importorskip("kubernetes_validate")
OMNI_DEMO = REPO / "examples/omni_demo/pipeline.yaml"
CRDS = {"ServiceMonitor"}  # not in the core schemas


def _objects(bundle: K8sBundle) -> list[dict[str, Any]]:
    return [*bundle.manifests, *bundle.secrets]


def _of(bundle: K8sBundle, kind: str) -> list[dict[str, Any]]:
    return [o for o in bundle.manifests if o["kind"] == kind]


def _validate(bundle: K8sBundle) -> None:
    for obj in _objects(bundle):
        if obj["kind"] in CRDS:
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _check_wiring(bundle: K8sBundle, pipeline: Path) -> None:
    deployments = _of(bundle, "Deployment")
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in deployments}
    for d in deployments:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in _of(bundle, "Service"):
        selector = svc["spec"]["selector"]
        chosen = [t for t in pods.values() if selector.items() <= t["metadata"]["labels"].items()]
        assert chosen, f"Service {svc['metadata']['name']} selects no pod"
        served = {p["containerPort"] for t in chosen for c in t["spec"]["containers"]
                  for p in c.get("ports", ())}  # fmt: skip
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in served, (svc["metadata"]["name"], port)
    for template in pods.values():
        volumes = {v["name"] for v in template["spec"]["volumes"]}
        for c in template["spec"]["containers"]:
            served = {p["containerPort"] for p in c.get("ports", ())}
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                port = _probe_port(probe)
                assert port in served, (c["name"], kind, port, served)
            for mount in c["volumeMounts"]:
                assert mount["name"] in volumes, (c["name"], mount)
    cfg = load_pipeline(pipeline)
    pod_of = {}
    for name, template in pods.items():
        for c in template["spec"]["containers"]:
            stage_arg = c["args"][c["args"].index("--stage") + 1] if "--stage" in c["args"] else ""
            for stage in filter(None, stage_arg.split(",")):
                pod_of[stage] = name
                gpus = cfg.stage(stage).gpus
                limit = c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
                if cfg.stage(stage).tp_size == 1:
                    assert limit == len(gpus), (stage, limit, gpus)
                else:
                    assert limit == (1 if gpus else 0), (stage, limit)
    assert set(pod_of) == set(cfg.stage_names), "every stage runs in some pod"
    for src, dst in shm_edges(cfg):
        assert pod_of[src] == pod_of[dst], f"shm edge {src}->{dst} crosses pods"


def _probe_port(probe: dict[str, Any]) -> int:
    if "grpc" in probe:
        return probe["grpc"]["port"]
    if "httpGet" in probe:
        return probe["httpGet"]["port"]
    if "tcpSocket" in probe:
        return probe["tcpSocket"]["port"]
    command = " ".join(probe["exec"]["command"])
    return int(re.search(r"localhost:(\d+)", command).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "pipeline", [QUICKSTART, STREAMING, OMNI_DEMO], ids=lambda p: p.parent.name
)
def test_examples_validate_and_wire_up(pipeline: Path) -> None:
    bundle = generate(pipeline, K8sOptions())
    _validate(bundle)
    _check_wiring(bundle, pipeline)


def test_qwen3_omni_mounts_its_model_claim_read_only() -> None:
    bundle = generate(QWEN3_OMNI, K8sOptions(model_claim="qwen3-omni-weights"))
    _validate(bundle)
    _check_wiring(bundle, QWEN3_OMNI)
    config = _of(bundle, "ConfigMap")[0]["data"]["pipeline.yaml"]
    assert "model_path: /model" in config
    readers = 0
    for d in _of(bundle, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        for c in spec["containers"]:
            mounts = [m for m in c["volumeMounts"] if m["mountPath"] == "/model"]
            if mounts:
                readers += 1
                assert mounts[0]["readOnly"] and claims
                assert claims[0]["persistentVolumeClaim"] == {
                    "claimName": "qwen3-omni-weights",
                    "readOnly": True,
                }
    assert readers >= 5


def test_the_coordinator_serves_the_client_api_kserve_and_http() -> None:
    bundle = generate(OMNI_DEMO, K8sOptions())
    (svc,) = [s for s in _of(bundle, "Service") if s["metadata"]["name"] == "omni-demo-coordinator"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "grpc": 50051, "http": 8000, "metrics": 9400,
    }  # fmt: skip
    quick = generate(QUICKSTART, K8sOptions())
    ports = [s for s in _of(quick, "Service") if s["metadata"]["name"].endswith("coordinator")]
    assert [p["name"] for p in ports[0]["spec"]["ports"]] == ["grpc", "metrics"]


def test_secured_deployments_probe_with_omnirail_health_and_mount_secrets(
    tmp_path: Path,
) -> None:
    token = "tok-" + secrets.token_hex(8)
    tokens = tmp_path / "tokens"
    tokens.write_text(token + "\n")
    bundle = generate(OMNI_DEMO, K8sOptions(tls_dir=tmp_path / "tls", tokens_file=tokens))
    _validate(bundle)
    _check_wiring(bundle, OMNI_DEMO)
    assert {s["metadata"]["name"] for s in bundle.secrets} == {"omni-demo-tls", "omni-demo-tokens"}
    for d in _of(bundle, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "gateway":
                assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
                continue
            assert c["readinessProbe"]["exec"]["command"][:2] == ["omnirail", "health"]
    written = write_bundle(bundle, tmp_path / "out")
    assert (tmp_path / "out" / "secrets.yaml") in written
    assert (tmp_path / "out" / "secrets.yaml").stat().st_mode & 0o077 == 0
    assert token not in (tmp_path / "out" / "omnirail.yaml").read_text()
    secret = (tmp_path / "out" / "secrets.yaml").read_text()
    assert base64.b64encode(f"{token}\n".encode()).decode() in secret


def test_secured_metrics_are_scraped_over_https_with_the_mesh_certificate(
    tmp_path: Path,
) -> None:
    bundle = generate(OMNI_DEMO, K8sOptions(tls_dir=tmp_path / "tls", service_monitor=True))
    _validate(bundle)
    (monitor,) = _of(bundle, "ServiceMonitor")
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["scheme"] == "https"
        # prometheus-operator's SafeTLSConfig, from the Secret holding the material.
        assert endpoint["tlsConfig"] == {
            "ca": {"secret": {"name": "omni-demo-tls", "key": "ca.pem"}},
            "cert": {"secret": {"name": "omni-demo-tls", "key": "mesh.pem"}},
            "keySecret": {"name": "omni-demo-tls", "key": "mesh.key"},
            "serverName": "omni-demo-mesh",
        }
    (secret,) = bundle.secrets
    assert {"ca.pem", "mesh.pem", "mesh.key"} <= set(secret["data"])
    for d in _of(bundle, "Deployment"):
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        if "prometheus.io/port" in annotations:
            assert annotations["prometheus.io/scheme"] == "https"
    plain = generate(OMNI_DEMO, K8sOptions(service_monitor=True))
    (monitor,) = _of(plain, "ServiceMonitor")
    assert all("tlsConfig" not in e and "scheme" not in e for e in monitor["spec"]["endpoints"])


def test_an_output_that_cannot_be_written_is_one_error_naming_it(tmp_path: Path) -> None:
    bundle = generate(REPO / "examples/quickstart/pipeline.yaml", K8sOptions())
    (tmp_path / "file").write_text("")
    with pytest.raises(ComposeError, match="file: cannot make the directory: File exists"):
        write_bundle(bundle, tmp_path / "file")
    (tmp_path / "out" / "omnirail.yaml").mkdir(parents=True)
    with pytest.raises(ComposeError, match=r"cannot write .*out/omnirail\.yaml: Is a directory"):
        write_bundle(bundle, tmp_path / "out")


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"namespace": "Bad_NS"}, "--namespace 'Bad_NS': not a namespace name"),
        ({"namespace": "a" * 64}, "not a namespace name"),
        ({"model_claim": ""}, "--model-claim '': not a PersistentVolumeClaim name"),
        ({"model_claim": "Models"}, "not a PersistentVolumeClaim name"),
        ({"otlp_endpoint": "collector"}, "--otlp-endpoint 'collector': expected host:port"),
        ({"otlp_endpoint": "ftp://c:4317"}, "expected host:port or http(s)://host:port"),
        ({"otlp_endpoint": "c:99999"}, "--otlp-endpoint 'c:99999': Port out of range"),
        ({"otlp_endpoint": "http://c:4317/v1/traces"}, "expected host:port"),
        ({"image": "omnirail latest"}, "--image 'omnirail latest': not an image reference"),
        ({"memory_request": "lots"}, "memory_request 'lots': not a quantity"),
        ({"gpus_per_node": 0}, "--gpus-per-node 0: must be at least 1"),
    ],
)
def test_options_kubernetes_would_refuse_are_refused_naming_the_flag(
    options: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ComposeError) as ei:
        generate(REPO / "examples/quickstart/pipeline.yaml", K8sOptions(**options))
    assert str(ei.value).startswith(problem) or problem in str(ei.value), ei.value


@pytest.mark.parametrize(
    "options",
    [
        {"namespace": "omni-prod", "model_claim": "models.v1"},
        {"otlp_endpoint": "otel-collector.observability:4317"},
        {"otlp_endpoint": "https://[fd00::1]:4317", "memory_request": "1.5Gi"},
        {"image": "registry.example.com:5000/omnirail@sha256:" + "0" * 64},
    ],
)
def test_options_kubernetes_takes_are_taken(options: dict[str, Any]) -> None:
    bundle = generate(REPO / "examples/quickstart/pipeline.yaml", K8sOptions(**options))
    _validate(bundle)


def _pipeline(tmp_path: Path, stages: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"name: t\nstages:\n{stages}")
    return path


def test_an_shm_edge_between_replicated_pods_is_refused(tmp_path: Path) -> None:
    path = _pipeline(
        tmp_path,
        "  - {name: a, factory: tests.integration.stagefns:make_echo, next: b}\n"
        "  - {name: b, factory: tests.integration.stagefns:make_echo, terminal: true,"
        " replicas: 2}\n",
    )
    with pytest.raises(ComposeError, match=r"stages\[b\]\.replicas: 2, but it shares shm edges"):
        generate(path, K8sOptions(resolve=False))


def test_more_gpus_than_a_node_has_is_refused(tmp_path: Path) -> None:
    path = _pipeline(
        tmp_path,
        "  - {name: a, factory: tests.integration.stagefns:make_echo, next: b, gpu: 3,"
        " relay_to: {b: {backend: nixl}}}\n"
        "  - {name: b, factory: tests.integration.stagefns:make_echo, terminal: true,"
        " gpu: [0, 1, 2], tp_size: 3}\n",
    )
    with pytest.raises(ComposeError, match=r"stages\[b\]\.gpu: .* needs 3 GPUs.*gpus-per-node 2"):
        generate(path, K8sOptions(gpus_per_node=2, resolve=False))
    bundle = generate(path, K8sOptions(gpus_per_node=4, resolve=False))
    _validate(bundle)
    limits = {
        c["name"]: c["resources"]["limits"]
        for d in _of(bundle, "Deployment")[1:]
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    containers = {
        c["name"]: c
        for d in _of(bundle, "Deployment")[1:]
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    # Followers serve nothing: rank 0 has the port and the probes.
    assert "ports" in containers["b-tp0"] and "readinessProbe" in containers["b-tp0"]
    assert "ports" not in containers["b-tp1"] and "readinessProbe" not in containers["b-tp1"]
    assert "--tp-init" in containers["b-tp2"]["args"]
    # One GPU per TP rank, each rank a container of one pod; `gpu: 3` is one GPU.
    assert limits == {
        "a": {"nvidia.com/gpu": 1},
        "b-tp0": {"nvidia.com/gpu": 1},
        "b-tp1": {"nvidia.com/gpu": 1},
        "b-tp2": {"nvidia.com/gpu": 1},
    }


def test_a_model_without_a_claim_is_refused() -> None:
    with pytest.raises(ComposeError, match="give --model-claim"):
        generate(QWEN3_OMNI, K8sOptions())


def test_replicas_get_a_disruption_budget(tmp_path: Path) -> None:
    path = _pipeline(
        tmp_path,
        "  - {name: a, factory: tests.integration.stagefns:make_echo, next: b,"
        " relay_to: {b: {backend: nixl}}}\n"
        "  - {name: b, factory: tests.integration.stagefns:make_echo, terminal: true,"
        " replicas: 3}\n",
    )
    bundle = generate(path, K8sOptions(service_monitor=True, resolve=False))
    _validate(bundle)
    (pdb,) = _of(bundle, "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "t-b" and pdb["spec"]["maxUnavailable"] == 1
    deployments = {d["metadata"]["name"]: d["spec"]["replicas"] for d in _of(bundle, "Deployment")}
    assert deployments == {"t-coordinator": 1, "t-a": 1, "t-b": 3}
    (monitor,) = _of(bundle, "ServiceMonitor")
    assert {e["port"] for e in monitor["spec"]["endpoints"]} >= {"metrics", "metrics-0"}


def test_the_committed_example_is_what_its_header_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omnirail.cli import main

    monkeypatch.chdir(REPO)
    committed = REPO / "examples" / "omni_demo" / "k8s" / "omnirail.yaml"
    text = committed.read_text()
    argv = shlex.split(text.splitlines()[2].lstrip("#").strip())
    assert argv[:2] == ["omnirail", "k8s"]
    assert argv[argv.index("-o") + 1] == "examples/omni_demo/k8s"
    argv[argv.index("-o") + 1] = str(tmp_path)
    assert main(argv[1:]) == 0
    made = (tmp_path / "omnirail.yaml").read_text().splitlines()[3:]
    assert made == text.splitlines()[3:], f"{committed} is stale: run the command in its header"
