"""`omnirail k8s FILE -o DIR`: plain Kubernetes manifests for a pipeline.

Objects (all labelled `app.kubernetes.io/instance: <app>`, `<app>` the pipeline's name):
- a ConfigMap with the pipeline's directory (its YAML, derived for the cluster when model
  paths or edges change, and the modules next to it), mounted read-only at /pipeline;
- the coordinator's Deployment (one replica; with `api.openai`, the OpenAI gateway as a
  second container dialling it on localhost) and its Service: the client API and KServe
  on 50051, HTTP on 8000 when there is a gateway;
- per workload (k8s_plan.py: stage processes, pods joined by shm edges, TP ranks), a
  Deployment with its replicas, a Service, and a PodDisruptionBudget when it has more
  than one replica;
- with `--tls DIR` / `--tokens-file FILE`, Secrets holding the material and the tokens
  (in `secrets.yaml`, apart: not for version control).

Every container: gRPC health probes on its own port (Kubernetes' native `grpc` probe; an
exec of `omnirail health` when TLS is on, which the native probe cannot speak), resource
requests (`torch_threads` CPUs), GPU limits from `gpu:`, Prometheus scrape annotations,
and the image's non-root user (10001) with no privilege escalation and no capabilities.
Stages advertise their pod IP; cross-pod edges keep their backends (shm edges never cross
pods: they share one), with the container-safe defaults compose derives.
"""

from __future__ import annotations

import base64
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omnirail.config import PipelineConfig, load_pipeline
from omnirail.config import security as sec
from omnirail.ops.compose_edges import derive_pipeline
from omnirail.ops.compose_groups import ComposeError, dns_label
from omnirail.ops.compose_models import MODEL_MOUNT, ModelMount, model_reads
from omnirail.ops.compose_tls import TLS_MOUNT, ensure_material, material_env
from omnirail.ops.k8s_options import IMAGE, K8sOptions
from omnirail.ops.k8s_plan import Container, Workload, plan_workloads

GRPC_PORT = 50051
HTTP_PORT = 8000
METRICS_PORT = 9400
TP_PORT = 29500
PIPELINE_MOUNT = "/pipeline"
TOKENS_MOUNT = "/etc/omnirail/tokens"
USER_ID = 10001  # the Dockerfile's USER
KUBERNETES_VERSION = "1.37.0"  # what the tests validate against (kubernetes-validate)
MAX_CONFIGMAP = 900 * 1024  # the API server's limit is 1 MiB, object and all
_PIPELINE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".txt")


@dataclass
class K8sBundle:
    manifests: list[dict[str, Any]]
    secrets: list[dict[str, Any]] = field(default_factory=list)
    header: str = ""

    def text(self) -> str:
        return self.header + yaml.safe_dump_all(self.manifests, sort_keys=False, width=100)


def generate(
    pipeline: str | os.PathLike[str], options: K8sOptions, output: Path | None = None
) -> K8sBundle:
    """Checks everything and builds the manifests; writes nothing but, with `--tls`, the
    material it makes in that folder when it holds none. `output`: the folder they are
    for (named in the header's command)."""
    options.check()
    source = Path(pipeline).resolve()
    cfg = load_pipeline(source, resolve=options.resolve)
    app = dns_label(cfg.name or "pipeline")[:40].rstrip("-")
    mounts = _model_mounts(cfg, options)
    derived = derive_pipeline(cfg, source, options.edge_relays, options.resolve, mounts)
    pipeline_text = source.read_text() if derived is None else derived[1]
    if derived is not None:
        cfg = derived[0]
    workloads = plan_workloads(cfg, options.gpus_per_node)
    names = _Names(app, options.namespace)
    files = _pipeline_files(source.parent, source.name, pipeline_text)
    build = _Builder(cfg, options, names, mounts, source.name)
    manifests = [names.meta_obj("v1", "ConfigMap", names.pipeline, data=files)]
    manifests += build.coordinator()
    for workload in workloads:
        manifests += build.workload(workload)
    if options.service_monitor:
        manifests.append(build.service_monitor(workloads))
    hosts = [names.mesh, names.coordinator, *(names.of(w) for w in workloads)]
    if options.namespace:  # clients outside the namespace use the qualified name
        hosts.append(f"{names.coordinator}.{options.namespace}.svc")
    secrets = _secrets(names, options, hosts)
    return K8sBundle(manifests, secrets, _header(source, options, output))


def write_bundle(bundle: K8sBundle, out: Path) -> list[Path]:
    """Writes omnirail.yaml (and secrets.yaml, owner-only) into the directory `out`,
    made if missing; ComposeError names the path that cannot be written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ComposeError(f"-o {out}: cannot make the directory: {exc.strerror or exc}") from None
    written = [out / "omnirail.yaml"]
    path = written[0]
    try:
        path.write_text(bundle.text())
        if bundle.secrets:
            path = out / "secrets.yaml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("# Secrets: apply, do not commit.\n")
                f.write(yaml.safe_dump_all(bundle.secrets, sort_keys=False))
            written.append(path)
    except OSError as exc:
        raise ComposeError(f"cannot write {path}: {exc.strerror or exc}") from None
    return written


class _Names:
    def __init__(self, app: str, namespace: str | None) -> None:
        self.app = app
        self.namespace = namespace
        self.pipeline = f"{app}-pipeline"
        self.coordinator = f"{app}-coordinator"
        self.tls = f"{app}-tls"
        self.tokens = f"{app}-tokens"
        self.mesh = f"{app}-mesh"  # the name every mesh hop verifies (TLS)

    def of(self, workload: Workload) -> str:
        return f"{self.app}-{workload.name}"

    def labels(self, component: str | None = None) -> dict[str, str]:
        out = {"app.kubernetes.io/name": "omnirail", "app.kubernetes.io/instance": self.app}
        if component is not None:
            out["app.kubernetes.io/component"] = component
        return out

    def meta(self, name: str, component: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "labels": self.labels(component)}
        if self.namespace:
            meta["namespace"] = self.namespace
        return meta

    def meta_obj(self, api: str, kind: str, name: str, **body: Any) -> dict[str, Any]:
        return {"apiVersion": api, "kind": kind, "metadata": self.meta(name), **body}


class _Builder:
    def __init__(
        self,
        cfg: PipelineConfig,
        options: K8sOptions,
        names: _Names,
        mounts: list[ModelMount],
        pipeline_file: str,
    ) -> None:
        self.cfg = cfg
        self.options = options
        self.names = names
        self.mounts = mounts
        self.pipeline = f"{PIPELINE_MOUNT}/{pipeline_file}"
        self.tls = options.tls_dir is not None
        self.coordinator_address = f"{names.coordinator}:{GRPC_PORT}"

    # ---- the coordinator (and gateway) ---------------------------------------------

    def coordinator(self) -> list[dict[str, Any]]:
        names = self.names
        component = "coordinator"
        main = self._container(
            "coordinator",
            [
                "coordinator",
                "--pipeline",
                self.pipeline,
                "--listen",
                f"0.0.0.0:{GRPC_PORT}",
                *self._metrics(METRICS_PORT),
            ],
            GRPC_PORT,
            METRICS_PORT,
            cpu="500m",
            memory="512Mi",
            tokens=True,
        )
        containers = [main]
        ports = [_port("grpc", GRPC_PORT)]
        if self.cfg.api.openai is not None:
            containers.append(self._gateway())
            ports.append(_port("http", HTTP_PORT))
        ports.append(_port("metrics", METRICS_PORT))
        deployment = self._deployment(names.coordinator, component, 1, containers, shm_mb=0)
        # One coordinator at a time: stages attach to the one that is up.
        deployment["spec"]["strategy"] = {"type": "Recreate"}
        service = self._service(names.coordinator, component, ports)
        return [deployment, service]

    def _gateway(self) -> dict[str, Any]:
        container = self._container(
            "gateway",
            [
                "gateway",
                "--pipeline",
                self.pipeline,
                "--coordinator",
                f"localhost:{GRPC_PORT}",
                "--listen",
                f"0.0.0.0:{HTTP_PORT}",
            ],
            None,
            None,
            cpu="500m",
            memory="256Mi",
            tokens=True,
        )
        container["ports"] = [{"name": "http", "containerPort": HTTP_PORT}]
        scheme = "HTTPS" if self.tls else "HTTP"
        # Ready once the mesh behind it is; alive while it accepts connections (a stage
        # that is down must not get the gateway restarted).
        container["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": HTTP_PORT, "scheme": scheme},
            "periodSeconds": 5,
        }
        container["livenessProbe"] = {"tcpSocket": {"port": HTTP_PORT}, "periodSeconds": 10}
        return container

    # ---- stage workloads -----------------------------------------------------------

    def workload(self, workload: Workload) -> list[dict[str, Any]]:
        name = self.names.of(workload)
        containers = []
        ports = []
        for i, c in enumerate(workload.containers):
            port, metrics = GRPC_PORT + i, METRICS_PORT + i
            containers.append(self._stage(c, port, metrics, workload))
            if not c.follower:
                ports += [_port(f"grpc-{i}", port), _port(f"metrics-{i}", metrics)]
        out = [
            self._deployment(name, "stage", workload.replicas, containers, workload.shm_mb),
            self._service(name, "stage", ports, workload=name),
        ]
        if workload.replicas > 1:
            out.append(
                self.names.meta_obj(
                    "policy/v1",
                    "PodDisruptionBudget",
                    name,
                    spec={
                        "maxUnavailable": 1,
                        "selector": {"matchLabels": self._selector(name)},
                    },
                )
            )
        return out

    def _stage(self, c: Container, port: int, metrics: int, workload: Workload) -> dict[str, Any]:
        args = [
            "stage",
            *("--pipeline", self.pipeline),
            *("--stage", ",".join(c.stages)),
            *("--coordinator", self.coordinator_address),
        ]
        if not c.follower:
            args += [
                *("--listen", f"0.0.0.0:{port}"),
                # Each pod of a workload is reached at its own address.
                *("--advertise", f"$(POD_IP):{port}"),
                *self._metrics(metrics),
            ]
        # Containers of one pod share /dev/shm and may share pids: names apart.
        args += ["--shm-prefix", f"omnirail-{c.name}"]
        if c.tp_rank is not None:
            args += ["--tp-rank", str(c.tp_rank), "--tp-init", f"tcp://127.0.0.1:{TP_PORT}"]
        threads = max(self.cfg.stage(s).torch_threads for s in c.stages)
        # A follower rank serves nothing (rank 0 speaks for the group): no ports, no
        # probes; if it dies the group breaks, rank 0 exits, and the pod restarts both.
        container = self._container(
            c.name,
            args,
            None if c.follower else port,
            None if c.follower else metrics,
            cpu=str(threads),
            memory=self.options.memory_request,
        )
        if c.gpus:
            container["resources"]["limits"] = {"nvidia.com/gpu": len(c.gpus)}
            # The device plugin shows the container its GPUs renumbered from 0: the stage
            # maps its config ids through this (stage_service/placement.py).
            container["env"].append({"name": "OMNIRAIL_GPUS", "value": ",".join(map(str, c.gpus))})
        readers = [m for m in self.mounts if set(m.stages) & set(c.stages)]
        for i, mount in enumerate(readers):
            container["volumeMounts"].append(
                {"name": f"model-{i}", "mountPath": mount.target, "readOnly": True}
            )
        if workload.shm_mb:
            container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        return container

    # ---- shared pieces -------------------------------------------------------------

    def _metrics(self, port: int) -> list[str]:
        return ["--metrics-host", "0.0.0.0", "--metrics-port", str(port)]

    def _container(
        self,
        name: str,
        args: list[str],
        port: int | None,
        metrics: int | None,
        *,
        cpu: str,
        memory: str,
        tokens: bool = False,
    ) -> dict[str, Any]:
        env: list[dict[str, Any]] = [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "OTEL_SERVICE_NAME", "value": f"omnirail-{name}"},
        ]
        if self.options.otlp_endpoint:
            env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": self.options.otlp_endpoint})
        mounts = [{"name": "pipeline", "mountPath": PIPELINE_MOUNT, "readOnly": True}]
        if self.tls:
            env += [{"name": k, "value": v} for k, v in material_env().items()]
            env += [
                # Stages dial each other at pod IPs, which no certificate can name ahead:
                # every mesh hop verifies this name, which the mesh certificate carries.
                {"name": sec.ENV_SERVER_NAME, "value": self.names.mesh},
            ]
            mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        if tokens and self.options.tokens_file is not None:
            env.append({"name": sec.ENV_TOKENS_FILE, "value": f"{TOKENS_MOUNT}/tokens"})
            mounts.append({"name": "tokens", "mountPath": TOKENS_MOUNT, "readOnly": True})
        container: dict[str, Any] = {
            "name": name,
            "image": self.options.image,
            "args": args,
            "env": env,
            "resources": {"requests": {"cpu": cpu, "memory": memory}},
            "volumeMounts": mounts,
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
        if port is not None:
            container["ports"] = [{"name": "grpc", "containerPort": port}]
            if metrics is not None:
                container["ports"].append({"name": "metrics", "containerPort": metrics})
            container["readinessProbe"] = {**self._probe(port), "periodSeconds": 5}
            container["livenessProbe"] = {
                **self._probe(port),
                "periodSeconds": 10,
                "failureThreshold": 6,
            }
            # Models take a while to load: liveness waits for the first readiness.
            container["startupProbe"] = {
                **self._probe(port),
                "periodSeconds": 5,
                "failureThreshold": 120,
            }
        return container

    def _probe(self, port: int) -> dict[str, Any]:
        if self.tls:  # the native grpc probe speaks no TLS
            command = ["omnirail", "health", "--address", f"localhost:{port}"]
            return {"exec": {"command": command}, "timeoutSeconds": 5}
        return {"grpc": {"port": port}, "timeoutSeconds": 5}

    def _selector(self, name: str) -> dict[str, str]:
        return {**self.names.labels(), "omnirail.io/workload": name}

    def _deployment(
        self,
        name: str,
        component: str,
        replicas: int,
        containers: list[dict[str, Any]],
        shm_mb: int,
    ) -> dict[str, Any]:
        volumes: list[dict[str, Any]] = [
            {"name": "pipeline", "configMap": {"name": self.names.pipeline}}
        ]
        if shm_mb:
            volumes.append(
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_mb}Mi"}}
            )
        if self.tls:
            volumes.append(
                {"name": "tls", "secret": {"secretName": self.names.tls, "defaultMode": 0o440}}
            )
        if any(m["name"] == "tokens" for c in containers for m in c["volumeMounts"]):
            volumes.append(
                {
                    "name": "tokens",
                    "secret": {"secretName": self.names.tokens, "defaultMode": 0o440},
                }
            )
        claims = {m["name"] for c in containers for m in c["volumeMounts"]}
        for i, _ in enumerate(self.mounts):
            if f"model-{i}" in claims:
                volumes.append(
                    {
                        "name": f"model-{i}",
                        "persistentVolumeClaim": {
                            "claimName": self.options.model_claim,
                            "readOnly": True,
                        },
                    }
                )
        metrics = next(
            (p["containerPort"] for c in containers for p in c.get("ports", ())
             if p["name"] == "metrics"),
            None,
        )  # fmt: skip
        annotations = {}
        if metrics is not None:
            annotations = {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(metrics),
                "prometheus.io/path": "/metrics",
                "prometheus.io/scheme": "https" if self.tls else "http",
            }
        template = {
            "metadata": {
                "labels": {**self._selector(name), **self.names.labels(component)},
                "annotations": annotations,
            },
            "spec": {
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": USER_ID,
                    "runAsGroup": USER_ID,
                    "fsGroup": USER_ID,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                # Draining takes up to the pipeline's drain_s; SIGKILL must not cut it short.
                "terminationGracePeriodSeconds": int(self.cfg.drain_s) + 5,
                "containers": containers,
                "volumes": volumes,
            },
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.names.meta(name, component),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": self._selector(name)},
                "template": template,
            },
        }

    def _service(
        self, name: str, component: str, ports: list[dict[str, Any]], workload: str | None = None
    ) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.names.meta(name, component),
            "spec": {"selector": self._selector(workload or name), "ports": ports},
        }

    def service_monitor(self, workloads: list[Workload]) -> dict[str, Any]:
        """One ServiceMonitor (prometheus-operator) scraping every metrics port."""
        ports = ["metrics", *(f"metrics-{i}" for w in workloads for i in range(len(w.containers)))]
        endpoint: dict[str, Any] = {"path": "/metrics"}
        if self.tls:
            # HTTPS, showing the mesh's certificate (the mesh is mutual), and verifying the
            # name every mesh hop verifies: Prometheus dials pod IPs, which no certificate
            # names ahead.
            secret = self.names.tls
            endpoint["scheme"] = "https"
            endpoint["tlsConfig"] = {
                "ca": {"secret": {"name": secret, "key": "ca.pem"}},
                "cert": {"secret": {"name": secret, "key": "mesh.pem"}},
                "keySecret": {"name": secret, "key": "mesh.key"},
                "serverName": self.names.mesh,
            }
        return self.names.meta_obj(
            "monitoring.coreos.com/v1",
            "ServiceMonitor",
            self.names.app,
            spec={
                "selector": {"matchLabels": self.names.labels()},
                "endpoints": [{"port": p, **endpoint} for p in dict.fromkeys(ports)],
            },
        )


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}


def _model_mounts(cfg: PipelineConfig, options: K8sOptions) -> list[ModelMount]:
    reads = model_reads(cfg, options.resolve)
    if not reads:
        return []
    if options.model_claim is None:
        first = reads[0]
        raise ComposeError(
            f"{first.field}: stage {first.stage!r} reads {first.value!r}; give --model-claim "
            "CLAIM, a PersistentVolumeClaim holding that directory (mounted read-only)"
        )
    written = list(dict.fromkeys(r.value for r in reads))
    if len(written) > 1:
        raise ComposeError(
            f"the stages read {len(written)} model directories ({written}); one claim holds one"
        )
    return [ModelMount(Path(written[0]).resolve(), written[0], MODEL_MOUNT, tuple(reads))]


def _pipeline_files(folder: Path, name: str, pipeline_text: str) -> dict[str, str]:
    files: dict[str, str] = {}
    for path in sorted(folder.iterdir()):
        generated = ".compose." in path.name or path.name.endswith(".prometheus.yml")
        if path.is_file() and path.suffix in _PIPELINE_SUFFIXES and not generated:
            files[path.name] = path.read_text()
    files[name] = pipeline_text
    size = sum(len(k) + len(v.encode()) for k, v in files.items())
    if size > MAX_CONFIGMAP:
        raise ComposeError(
            f"{folder}: {size} bytes of pipeline files; a ConfigMap holds under 1 MiB "
            "(bake the modules into the image instead)"
        )
    return files


def _secrets(names: _Names, options: K8sOptions, hosts: list[str]) -> list[dict[str, Any]]:
    out = []
    if options.tls_dir is not None:
        ensure_material(options.tls_dir, [*hosts, "localhost"])
        data = {
            p.name: base64.b64encode(p.read_bytes()).decode()
            for p in sorted(options.tls_dir.iterdir())
            if p.is_file()
        }
        out.append(names.meta_obj("v1", "Secret", names.tls, type="Opaque", data=data))
    if options.tokens_file is not None:
        data = {"tokens": base64.b64encode(options.tokens_file.read_bytes()).decode()}
        out.append(names.meta_obj("v1", "Secret", names.tokens, type="Opaque", data=data))
    return out


def _header(source: Path, options: K8sOptions, output: Path | None) -> str:
    """The comment opening the file: the command that remakes it, paths relative to the
    directory it was made in (run it there)."""
    out = os.path.relpath(output.resolve(), Path.cwd()) if output is not None else "DIR"
    named = options.source_args or (os.path.relpath(source, Path.cwd()),)
    argv = ["omnirail", "k8s", *named, "-o", out]
    if options.image != IMAGE:
        argv += ["--image", options.image]
    if options.namespace:
        argv += ["--namespace", options.namespace]
    if options.model_claim:
        argv += ["--model-claim", options.model_claim]
    if options.otlp_endpoint:
        argv += ["--otlp-endpoint", options.otlp_endpoint]
    if options.service_monitor:
        argv.append("--service-monitor")
    if options.gpus_per_node is not None:
        argv += ["--gpus-per-node", str(options.gpus_per_node)]
    argv += [a for e in sorted(options.edge_relays) for a in ("--edge-relay", str(e))]
    return (
        "# Generated by `omnirail k8s`: edit the pipeline or the flags, not this file.\n"
        f"# Regenerate (in the directory it was made in):\n#   {shlex.join(argv)}\n"
    )
