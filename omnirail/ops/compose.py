"""`omnirail compose`: a docker compose deployment of any pipeline.

One service per stage process (and replica), the coordinator, Jaeger (every service's
spans over OTLP) and Prometheus (every service's /metrics). Services joined by `shm` edges
share an IPC namespace; `--edge-relay SRC->DST=BACKEND` moves edges onto a cross-container
backend in a derived pipeline file so they need not. The model directories the stages read
(`model_path`) are bind-mounted read-only into their services (`compose_models`).
Everything is checked and built in memory (`generate`) before anything is written
(`write_bundle`); the output is the same for the same inputs. Pure config work: importable
without torch.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from omnirail.config import load_pipeline
from omnirail.ops.compose_edges import EdgeRelay, derive_pipeline
from omnirail.ops.compose_groups import (
    ComposeError,
    IpcGroup,
    StageService,
    ipc_groups,
    plan_services,
)
from omnirail.ops.compose_models import MODEL_MOUNT, ModelDir, ModelMount, header_args, model_mounts
from omnirail.ops.compose_tls import check_tokens_file, ensure_material, prometheus_tls, secure
from omnirail.ops.health import ADDRESS_ENV

__all__ = [
    "MODEL_MOUNT",
    "ComposeBundle",
    "ComposeError",
    "ComposeOptions",
    "EdgeRelay",
    "ModelDir",
    "default_build_context",
    "generate",
    "write_bundle",
]

IMAGE = "omnirail:latest"
JAEGER_IMAGE = "jaegertracing/all-in-one:1.62.0"
PROMETHEUS_IMAGE = "prom/prometheus:v2.55.1"
GRPC_PORT = 50051  # every omnirail service, in its own container (the image's HEALTHCHECK)
HTTP_PORT = 8000  # the OpenAI gateway's, in its container
METRICS_PORT = 9464
PIPELINE_MOUNT = "/pipeline"
DependsCondition = Literal["service_started", "service_healthy"]


@dataclass(frozen=True)
class ComposeOptions:
    image: str = IMAGE
    jaeger_image: str = JAEGER_IMAGE
    prometheus_image: str = PROMETHEUS_IMAGE
    coordinator_port: int = GRPC_PORT  # published on the host
    # The OpenAI gateway's published port (pipelines with api.openai); 0: no gateway.
    http_port: int = HTTP_PORT
    depends_condition: DependsCondition = "service_started"
    edge_relays: tuple[EdgeRelay, ...] = ()
    # Directory holding the Dockerfile; None: no service builds, the image must exist.
    build_context: Path | None = None
    # Import factories and hooks while validating (off where the models' deps are missing).
    resolve: bool = True
    # Host directories for the model paths the pipeline names (`--model-dir`).
    model_dirs: tuple[ModelDir, ...] = ()
    # Every mounted model directory must exist now (off: `--no-check-model-dir`).
    check_model_dirs: bool = True
    # `--tls DIR` and `--tokens-file FILE` (compose_tls.py).
    tls_dir: Path | None = None
    tokens_file: Path | None = None
    # What names the pipeline in the header's command when it is not the pipeline file: a
    # checkpoint directory and its --set flags (`omnirail compose MODEL_DIR`).
    source_args: tuple[str, ...] = ()


@dataclass
class ComposeBundle:
    compose: dict[str, Any]
    text: str  # the compose file, header comment included
    output: Path | None  # None: stdout
    side_files: dict[Path, str] = field(default_factory=dict)  # written before the output
    # `--tls`: the folder for the mesh's material and the hosts its certificate names.
    tls_dir: Path | None = None
    tls_hosts: tuple[str, ...] = ()


def default_build_context(where: Path | None = None) -> Path | None:
    """`where` (default: the working directory) when it is an omnirail checkout's root,
    whose Dockerfile builds the image; else None: the compose file then names an image
    and builds nothing."""
    root = where if where is not None else Path.cwd()
    try:
        project = (root / "pyproject.toml").read_text(errors="replace")
    except OSError:
        return None
    if (root / "Dockerfile").is_file() and 'name = "omnirail"' in project:
        return root.resolve()
    return None


def generate(
    pipeline: str | os.PathLike[str], output: Path | None, options: ComposeOptions
) -> ComposeBundle:
    """Checks everything and builds the compose file and its side files; writes nothing."""
    source = Path(pipeline)
    _check_request(output, options)
    # Relative bind sources in a compose file start at its directory.
    base = Path.cwd() if output is None else output.resolve().parent
    cfg = load_pipeline(source, resolve=options.resolve)
    services = plan_services(cfg)
    pipeline_dir = source.resolve().parent
    paths = _Paths(
        base,
        pipeline_dir,
        pipeline_file=source.resolve(),
        prometheus_file=pipeline_dir / f"{source.stem}.prometheus.yml",
    )
    side_files = {paths.prometheus_file: _prometheus_config(services, options.tls_dir is not None)}
    mounts = model_mounts(
        cfg, pipeline_dir, options.model_dirs, options.check_model_dirs, options.resolve
    )
    derived = derive_pipeline(cfg, source, options.edge_relays, options.resolve, mounts)
    if derived is not None:
        cfg, text = derived
        paths = replace(paths, pipeline_file=pipeline_dir / f"{source.stem}.compose.yaml")
        side_files[paths.pipeline_file] = text
    clash = {source.resolve(), output.resolve() if output else None} & set(side_files)
    if clash:
        raise ComposeError(f"{clash.pop()}: would be overwritten by a generated side file")
    doc = _compose_doc(services, ipc_groups(cfg, services), mounts, paths, options)
    if cfg.api.openai is not None and options.http_port:
        doc["services"] = _with_gateway(doc["services"], paths, options)
    front = ("gateway",) if "gateway" in doc["services"] else ()
    hosts = ("coordinator", *front, *(s.name for s in services))
    if options.tls_dir is not None:
        tokens = options.tokens_file
        secure(
            doc["services"],
            hosts,
            paths.rel(options.tls_dir.resolve()),
            paths.rel(tokens.resolve()) if tokens is not None else None,
        )
    # A stopped service drains first (up to drain_s): SIGKILL must not cut that short.
    grace = f"{math.ceil(cfg.drain_s) + 5}s"
    for name, service in doc["services"].items():
        if name in ("coordinator", "gateway") or name in {s.name for s in services}:
            service["stop_grace_period"] = grace
    header = _header(source, output, options, base)
    text = header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100)
    tls_dir = options.tls_dir.resolve() if options.tls_dir is not None else None
    return ComposeBundle(doc, text, output, side_files, tls_dir, hosts if tls_dir else ())


def _check_request(output: Path | None, options: ComposeOptions) -> None:
    """Flag problems, found before the pipeline is even loaded."""
    if output is not None and not output.resolve().parent.is_dir():
        raise ComposeError(f"-o {output}: directory {output.parent} does not exist")
    if output is not None and output.is_dir():
        raise ComposeError(f"-o {output}: is a directory; name the compose file")
    if options.depends_condition not in ("service_started", "service_healthy"):
        raise ComposeError(f"--depends-condition {options.depends_condition!r}: not supported")
    if not 0 < options.coordinator_port < 65536:
        raise ComposeError(f"--coordinator-port {options.coordinator_port}: not in 1-65535")
    if not 0 <= options.http_port < 65536:
        raise ComposeError(f"--http-port {options.http_port}: not in 0-65535")
    if options.build_context is not None and not options.build_context.is_dir():
        raise ComposeError(f"--build-context {options.build_context}: not a directory")
    if options.tokens_file is not None:
        if options.tls_dir is None:
            raise ComposeError("--tokens-file needs --tls: tokens must not cross in plaintext")
        check_tokens_file(options.tokens_file)
    if options.tls_dir is not None and options.tls_dir.exists() and not options.tls_dir.is_dir():
        raise ComposeError(f"--tls {options.tls_dir}: not a directory")


def write_bundle(bundle: ComposeBundle) -> list[Path]:
    """Writes the side files and the compose file (unless it goes to stdout), all or none:
    each is written to a temporary file beside it first, and they replace their targets
    only once every one is written (a compose file that cannot be written leaves no side
    file beside the pipeline, and no target half-written)."""
    files = dict(bundle.side_files)
    if bundle.tls_dir is not None:
        for warning in ensure_material(bundle.tls_dir, bundle.tls_hosts):
            print(f"[omnirail] warning: {warning}", file=sys.stderr)
    if bundle.output is not None:
        files[bundle.output] = bundle.text
    written: dict[Path, tuple[Path, Path]] = {}  # target -> (the file it names, temporary)
    try:
        for path, text in files.items():
            real = Path(os.path.realpath(path))  # a symlinked target is written through
            tmp = real.with_name(f".{real.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(text, encoding="utf-8")
            except OSError as exc:
                raise ComposeError(f"cannot write {path}: {exc.strerror or exc}") from None
            written[path] = (real, tmp)
        for path, (real, tmp) in list(written.items()):
            try:
                os.replace(tmp, real)
            except OSError as exc:
                raise ComposeError(f"cannot write {path}: {exc.strerror or exc}") from None
            del written[path]
    finally:
        for _, tmp in written.values():
            tmp.unlink(missing_ok=True)
    return list(files)


# -- the compose document -------------------------------------------------------------


@dataclass(frozen=True)
class _Paths:
    base: Path  # the compose file's directory: relative bind sources start here
    pipeline_dir: Path
    pipeline_file: Path
    prometheus_file: Path

    def rel(self, path: Path) -> str:
        rel = os.path.relpath(path, self.base)
        # Compose reads a bare name as a named volume; "./" makes it a path.
        return rel if rel == "." or rel.startswith("..") else f"./{rel}"

    @property
    def in_container(self) -> str:
        return f"{PIPELINE_MOUNT}/{self.pipeline_file.relative_to(self.pipeline_dir)}"


def _compose_doc(
    services: list[StageService],
    groups: list[IpcGroup],
    mounts: list[ModelMount],
    paths: _Paths,
    options: ComposeOptions,
) -> dict[str, Any]:
    coordinator = _omnirail_service("coordinator", options, paths)
    if options.build_context is not None:
        # One service builds the image; the others use it by name.
        coordinator = {"build": {"context": paths.rel(options.build_context)}, **coordinator}
    coordinator["command"] = [
        "coordinator",
        *("--pipeline", paths.in_container),
        *("--listen", f"0.0.0.0:{GRPC_PORT}"),
        *_metrics_flags(),
    ]
    coordinator["ports"] = [f"{options.coordinator_port}:{GRPC_PORT}"]
    coordinator["depends_on"] = {"jaeger": {"condition": "service_started"}}
    out: dict[str, Any] = {"coordinator": _ordered(coordinator)}
    ipc_of = {m: g for g in groups for m in g.members}
    for svc in services:
        # The coordinator imports the factories but calls none: it needs no model files.
        models = [_model_bind(m, paths) for m in mounts if set(m.stages) & set(svc.stages)]
        out[svc.name] = _stage_service(svc, ipc_of.get(svc.name), models, paths, options)
    out["jaeger"] = {
        "image": options.jaeger_image,
        "environment": {"COLLECTOR_OTLP_ENABLED": "true"},
        "ports": ["16686:16686"],  # the UI; OTLP (4317) stays inside the network
    }
    out["prometheus"] = {
        "image": options.prometheus_image,
        "ports": ["9090:9090"],
        "volumes": [_bind(paths.rel(paths.prometheus_file), "/etc/prometheus/prometheus.yml")],
    }
    return {"services": out}


def _with_gateway(
    services: dict[str, Any], paths: _Paths, options: ComposeOptions
) -> dict[str, Any]:
    """The services with the OpenAI gateway after the coordinator (a client of its API)."""
    gateway = _omnirail_service("gateway", options, paths)
    gateway["command"] = [
        "gateway",
        *("--pipeline", paths.in_container),
        *("--coordinator", f"coordinator:{GRPC_PORT}"),
        *("--listen", f"0.0.0.0:{HTTP_PORT}"),
    ]
    gateway["ports"] = [f"{options.http_port}:{HTTP_PORT}"]
    # The image's health check (`omnirail health`) asks the gateway's /health, which says
    # 200 once the mesh behind it is ready.
    scheme = "https" if options.tls_dir is not None else "http"
    gateway["environment"][ADDRESS_ENV] = f"{scheme}://localhost:{HTTP_PORT}/health"
    gateway["depends_on"] = {"coordinator": {"condition": "service_started"}}
    out: dict[str, Any] = {}
    for name, service in services.items():
        out[name] = service
        if name == "coordinator":
            out["gateway"] = _ordered(gateway)
    return out


def _stage_service(
    svc: StageService,
    ipc: IpcGroup | None,
    models: list[dict[str, Any]],
    paths: _Paths,
    options: ComposeOptions,
) -> dict[str, Any]:
    service = _omnirail_service(svc.name, options, paths)
    service["volumes"] += models
    service["command"] = [
        "stage",
        *("--pipeline", paths.in_container),
        *("--stage", ",".join(svc.stages)),
        *("--coordinator", f"coordinator:{GRPC_PORT}"),
        *("--listen", f"0.0.0.0:{GRPC_PORT}"),
        *("--advertise", f"{svc.name}:{GRPC_PORT}"),
        *_metrics_flags(),
        # Processes in containers sharing an IPC namespace all tend to be pid 1, and shm
        # pool names are prefix-pid: the service name keeps them apart.
        *("--shm-prefix", f"omnirail-{svc.name}"),
    ]
    # Stages retry attaching (stage_service/attach.py): a started coordinator is enough.
    depends = {"coordinator": {"condition": options.depends_condition}}
    if ipc is not None and ipc.owner == svc.name:
        service["ipc"] = "shareable"
        service["shm_size"] = f"{ipc.shm_mb}m"
    elif ipc is not None:
        service["ipc"] = f"service:{ipc.owner}"
        depends[ipc.owner] = {"condition": "service_started"}
    service["depends_on"] = depends
    service["restart"] = svc.restart
    if svc.gpus:
        device = {"driver": "nvidia", "device_ids": [str(g) for g in svc.gpus]}
        device["capabilities"] = ["gpu"]
        service["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
        # The runtime shows the container only these GPUs, renumbered from 0: the stage
        # maps its config ids through this (stage_service/placement.py).
        service["environment"]["OMNIRAIL_GPUS"] = ",".join(str(g) for g in svc.gpus)
    return _ordered(service)


def _omnirail_service(name: str, options: ComposeOptions, paths: _Paths) -> dict[str, Any]:
    return {
        "image": options.image,
        "environment": {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317",
            "OTEL_SERVICE_NAME": f"omnirail-{name}",
        },
        # The whole directory: the pipeline may import modules next to it.
        "volumes": [_bind(paths.rel(paths.pipeline_dir), PIPELINE_MOUNT)],
    }


_KEY_ORDER = ("build", "image", "command", "environment", "ports", "volumes", "ipc")


def _ordered(service: dict[str, Any]) -> dict[str, Any]:
    """Keys in one order for every service, so files diff well."""
    first = [k for k in _KEY_ORDER if k in service]
    return {k: service[k] for k in [*first, *(k for k in service if k not in first)]}


def _metrics_flags() -> list[str]:
    # Always on: the deployment ships a Prometheus that scrapes every service.
    return ["--metrics-host", "0.0.0.0", "--metrics-port", str(METRICS_PORT)]


def _model_bind(mount: ModelMount, paths: _Paths) -> dict[str, Any]:
    # As written: an absolute path stays one; a relative one starts at the compose file.
    source = mount.given if os.path.isabs(mount.given) else paths.rel(mount.host)
    return _bind(source, mount.target)


def _bind(source: str, target: str) -> dict[str, Any]:
    return {"type": "bind", "source": source, "target": target, "read_only": True}


def _prometheus_config(services: list[StageService], tls: bool) -> str:
    names = ["coordinator", *(s.name for s in services)]
    job: dict[str, Any] = {"job_name": "omnirail"}
    if tls:  # HTTPS, and the mesh's certificate shown: compose meshes are mutual
        job["scheme"] = "https"
        job["tls_config"] = prometheus_tls()
    job["static_configs"] = [
        {"targets": [f"{n}:{METRICS_PORT}"], "labels": {"service": n}} for n in names
    ]
    config = {"global": {"scrape_interval": "5s"}, "scrape_configs": [job]}
    header = "# Generated by `omnirail compose`: every omnirail service's /metrics.\n"
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def _header(source: Path, output: Path | None, options: ComposeOptions, base: Path) -> str:
    """The comment opening the file: what made it and the command that remakes it, with
    paths relative to the compose file's directory (where it must be run)."""
    named = options.source_args or (os.path.relpath(source.resolve(), base),)
    argv = ["omnirail", "compose", *named]
    if output is not None:
        argv += ["-o", output.name]
    argv += [a for e in sorted(options.edge_relays) for a in ("--edge-relay", str(e))]
    # What the command gives when run where the header says to (`base`).
    defaults = ComposeOptions(build_context=default_build_context(base))
    for flag, attr in [
        ("--image", "image"),
        ("--jaeger-image", "jaeger_image"),
        ("--prometheus-image", "prometheus_image"),
        ("--coordinator-port", "coordinator_port"),
        ("--http-port", "http_port"),
        ("--depends-condition", "depends_condition"),
    ]:
        if getattr(options, attr) != getattr(defaults, attr):
            argv += [flag, str(getattr(options, attr))]
    if options.build_context != defaults.build_context:
        ctx = options.build_context
        argv += ["--build-context", "none" if ctx is None else os.path.relpath(ctx, base)]
    if not options.resolve:
        argv.append("--no-resolve")
    argv += header_args(options.model_dirs, options.check_model_dirs, base)
    if options.tls_dir is not None:
        argv += ["--tls", os.path.relpath(options.tls_dir.resolve(), base)]
    if options.tokens_file is not None:
        argv += ["--tokens-file", os.path.relpath(options.tokens_file.resolve(), base)]
    where = "this file's directory" if output is not None else "the directory it was made in"
    return (
        "# Generated by `omnirail compose`: edit the pipeline or the flags, not this file.\n"
        f"# Regenerate (in {where}):\n#   {shlex.join(argv)}\n"
    )
