"""`omnirail compose`: services, IPC namespaces, derived pipelines, side files and errors."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnirail.config import ConfigError, PipelineConfig, load_pipeline
from omnirail.ops.compose import (
    ComposeBundle,
    ComposeError,
    ComposeOptions,
    EdgeRelay,
    ModelDir,
    default_build_context,
    generate,
    write_bundle,
)

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "examples/quickstart/pipeline.yaml"
STREAMING = REPO / "examples/streaming/pipeline.yaml"
QWEN3_OMNI = REPO / "examples/qwen3_omni/pipeline.yaml"
FIXED = ["coordinator", "jaeger", "prometheus"]
OTLP = "http://jaeger:4317"


def gen(pipeline: Path, out: Path | None, *edges: str, **options: Any) -> ComposeBundle:
    relays = tuple(EdgeRelay.parse(e) for e in edges)
    return generate(pipeline, out, ComposeOptions(edge_relays=relays, **options))


def services(bundle: ComposeBundle) -> dict[str, dict[str, Any]]:
    return bundle.compose["services"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def ipc_of(bundle: ComposeBundle) -> dict[str, str]:
    return {n: s["ipc"] for n, s in services(bundle).items() if "ipc" in s}


def side_file(bundle: ComposeBundle, suffix: str) -> tuple[Path, str]:
    [(path, text)] = [(p, t) for p, t in bundle.side_files.items() if p.name.endswith(suffix)]
    return path, text


def prometheus_targets(bundle: ComposeBundle) -> list[str]:
    _, text = side_file(bundle, ".prometheus.yml")
    [job] = yaml.safe_load(text)["scrape_configs"]
    return [t for sc in job["static_configs"] for t in sc["targets"]]


# -- pipelines written to tmp_path ------------------------------------------------------


def split_pipeline(tmp_path: Path, **stage_extra: dict[str, Any]) -> Path:
    """a,b share process front_end; b fans out to c_x (shm) and d (ucx); both feed e, d
    over nixl. Every dotted path names a module next to the YAML."""
    mod = f"compose_stages_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(
        "def make(**kw):\n    return kw\n\n\ndef merge(p):\n    return p\n"
    )
    stages: list[dict[str, Any]] = [
        {"name": "a", "process": "front_end", "next": "b"},
        {"name": "b", "process": "front_end", "next": ["c_x", "d"]},
        {"name": "c_x", "next": "e"},
        {"name": "d", "next": "e", "relay_to": {"e": {"backend": "nixl"}}},
        {"name": "e", "wait_for": ["c_x", "d"], "merge_fn": f"{mod}:merge", "terminal": True},
    ]
    stages[1]["relay_to"] = {"d": {"backend": "ucx", "options": {"port": 7000}}}
    for s in stages:
        s["factory"] = f"{mod}:make"
        s.update(stage_extra.get(s["name"], {}))
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "split", "stages": stages}, sort_keys=False))
    return path


def small_pipeline(
    tmp_path: Path, stages: list[dict[str, Any]], factory: str = "make", **top: Any
) -> Path:
    """`factory`: make, or make_model (which takes the pipeline's model_path)."""
    mod = f"compose_small_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(
        "def make(**kw):\n    return kw\n\n\ndef make_model(model_path, **kw):\n    return kw\n"
    )
    for s in stages:
        s.setdefault("factory", f"{mod}:{factory}")
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({"name": "small", "stages": stages, **top}, sort_keys=False))
    return path


def chain(*names: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": n, "next": m} for n, m in itertools.pairwise(names)]
    return [*out, {"name": names[-1], "terminal": True}]


# -- the examples --------------------------------------------------------------------------


def test_quickstart_services_commands_env_and_ports(tmp_path: Path) -> None:
    out = tmp_path / "docker-compose.yml"
    bundle = gen(QUICKSTART, out, build_context=REPO)
    svc = services(bundle)
    stages = ["preprocess", "text-encoder", "image-encoder", "fuse"]
    assert list(svc) == ["coordinator", *stages, *FIXED[1:]]

    coord = svc["coordinator"]
    assert coord["build"] == {"context": os.path.relpath(REPO, tmp_path)}
    assert coord["ports"] == ["50051:50051"]
    assert coord["command"] == [
        "coordinator",
        *("--pipeline", "/pipeline/pipeline.yaml"),
        *("--listen", "0.0.0.0:50051"),
        *("--metrics-host", "0.0.0.0", "--metrics-port", "9464"),
    ]
    assert all("build" not in s for n, s in svc.items() if n != "coordinator")
    mount = {
        "type": "bind",
        "source": os.path.relpath(QUICKSTART.parent, tmp_path),
        "target": "/pipeline",
        "read_only": True,
    }
    for name in ["coordinator", *stages]:
        s = svc[name]
        assert s["image"] == "omnirail:latest"
        assert s["environment"] == {
            "OTEL_EXPORTER_OTLP_ENDPOINT": OTLP,
            "OTEL_SERVICE_NAME": f"omnirail-{name}",
        }
        assert s["volumes"] == [mount]
    cmd = svc["text-encoder"]["command"]
    assert cmd[0] == "stage"
    assert flag(cmd, "--stage") == "text_encoder"
    assert flag(cmd, "--coordinator") == "coordinator:50051"
    assert flag(cmd, "--listen") == "0.0.0.0:50051"
    assert flag(cmd, "--advertise") == "text-encoder:50051"
    assert flag(cmd, "--metrics-port") == "9464"
    assert flag(cmd, "--shm-prefix") == "omnirail-text-encoder"
    assert "ports" not in svc["text-encoder"]
    assert svc["text-encoder"]["depends_on"]["coordinator"] == {"condition": "service_started"}

    assert svc["jaeger"]["image"] == "jaegertracing/all-in-one:1.62.0"
    assert svc["jaeger"]["ports"] == ["16686:16686"]
    assert svc["prometheus"]["image"] == "prom/prometheus:v2.55.1"
    assert svc["prometheus"]["ports"] == ["9090:9090"]
    prom_path, _ = side_file(bundle, ".prometheus.yml")
    assert prom_path == QUICKSTART.parent / "pipeline.prometheus.yml"
    assert svc["prometheus"]["volumes"][0]["source"] == os.path.relpath(prom_path, tmp_path)
    assert svc["prometheus"]["volumes"][0]["target"] == "/etc/prometheus/prometheus.yml"
    assert prometheus_targets(bundle) == [f"{n}:9464" for n in ["coordinator", *stages]]
    assert list(bundle.side_files) == [prom_path]  # no edge changed: the original is used


def test_quickstart_shares_one_ipc_namespace_sized_for_its_senders() -> None:
    bundle = gen(QUICKSTART, None)
    assert ipc_of(bundle) == {
        "preprocess": "shareable",
        "text-encoder": "service:preprocess",
        "image-encoder": "service:preprocess",
        "fuse": "service:preprocess",
    }
    svc = services(bundle)
    # Three senders over shm: preprocess (2 edges), each encoder (1), 1024 MiB credit each.
    assert svc["preprocess"]["shm_size"] == f"{4 * 1024 + 64}m"
    assert "shm_size" not in svc["fuse"]
    assert svc["fuse"]["depends_on"]["preprocess"] == {"condition": "service_started"}


def test_streaming_example_stream_edges_share_ipc() -> None:
    bundle = gen(STREAMING, None, build_context=None)
    svc = services(bundle)
    assert list(svc) == ["coordinator", "thinker", "talker", "vocoder", *FIXED[1:]]
    assert "build" not in svc["coordinator"]
    assert ipc_of(bundle) == {
        "thinker": "shareable",
        "talker": "service:thinker",
        "vocoder": "service:thinker",
    }
    assert [flag(svc[n]["command"], "--stage") for n in ("thinker", "talker", "vocoder")] == [
        "thinker",
        "talker",
        "vocoder",
    ]
    assert prometheus_targets(bundle)[1:] == ["thinker:9464", "talker:9464", "vocoder:9464"]


def test_output_is_deterministic_and_says_how_to_regenerate(tmp_path: Path) -> None:
    path = split_pipeline(tmp_path)
    out = tmp_path / "docker-compose.yml"
    ctx = default_build_context()  # the default adds no flag to the command
    one = gen(path, out, "b->c_x=ucx", "c_x->e=nixl", coordinator_port=6000, build_context=ctx)
    two = gen(path, out, "c_x->e=nixl", "b->c_x=ucx", coordinator_port=6000, build_context=ctx)
    assert one.text == two.text
    assert one.side_files == two.side_files
    lines = one.text.splitlines()
    assert lines[0].startswith("# Generated by `omnirail compose`")
    assert lines[2] == (
        "#   omnirail compose pipeline.yaml -o docker-compose.yml "
        "--edge-relay 'b->c_x=ucx' --edge-relay 'c_x->e=nixl' --coordinator-port 6000"
    )
    _, text = side_file(one, ".compose.yaml")
    assert text.startswith("# Derived from pipeline.yaml by `omnirail compose`")
    no_build = gen(path, out, build_context=None).text.splitlines()[2]
    assert no_build.endswith("--build-context none") == (ctx is not None)


# -- process groups, IPC groups and relays -------------------------------------------------


def test_process_groups_and_a_cross_container_edge_split_ipc(tmp_path: Path) -> None:
    bundle = gen(split_pipeline(tmp_path), tmp_path / "c.yml")
    svc = services(bundle)
    assert list(svc) == ["coordinator", "front-end", "c-x", "d", "e", *FIXED[1:]]
    assert flag(svc["front-end"]["command"], "--stage") == "a,b"
    assert flag(svc["front-end"]["command"], "--advertise") == "front-end:50051"
    assert svc["front-end"]["environment"]["OTEL_SERVICE_NAME"] == "omnirail-front-end"
    # b->c_x and c_x->e are shm; b->d is ucx and d->e nixl, so d stays on its own.
    assert ipc_of(bundle) == {
        "front-end": "shareable",
        "c-x": "service:front-end",
        "e": "service:front-end",
    }
    assert svc["front-end"]["shm_size"] == f"{1024 + 1024 + 64}m"
    assert svc["c-x"]["volumes"][0]["source"] == "."  # the pipeline lies beside the output


def test_edge_relay_writes_a_loadable_derived_pipeline(tmp_path: Path) -> None:
    path = split_pipeline(tmp_path)
    out = tmp_path / "docker-compose.yml"
    bundle = gen(path, out, "b->c_x=ucx", "c_x->e=nixl")
    assert ipc_of(bundle) == {}  # no shm edge is left between containers
    derived, _ = side_file(bundle, ".compose.yaml")
    assert derived == tmp_path / "pipeline.compose.yaml"
    for s in services(bundle).values():
        if "command" in s:
            assert flag(s["command"], "--pipeline") == "/pipeline/pipeline.compose.yaml"

    written = write_bundle(bundle)
    assert set(written) == {derived, tmp_path / "pipeline.prometheus.yml", out}
    cfg = load_pipeline(derived)  # the same module resolution as the original
    assert cfg.relay_for("b", "c_x").backend == "ucx"
    assert cfg.relay_for("b", "c_x").options == {"ucx_config": {"TLS": "tcp"}}
    assert cfg.relay_for("c_x", "e").backend == "nixl"
    assert cfg.relay_for("c_x", "e").options == {"ucx_error_handling_mode": "peer"}
    # Untouched edges keep what the author wrote.
    assert cfg.relay_for("b", "d").options == {"port": 7000}
    assert cfg.relay_for("d", "e").backend == "nixl"
    assert cfg.relay_for("a", "b").backend == "shm"
    assert yaml.safe_load(out.read_text()) == bundle.compose


def test_edge_relay_keeps_options_the_author_set_and_skips_no_ops(tmp_path: Path) -> None:
    # Options valid for the edge's backend as written (shm) and for the one compose picks.
    opts = {"relay_to": {"e": {"options": {"copy_threads": 1}}}}
    path = split_pipeline(tmp_path, c_x=opts)
    bundle = gen(path, None, "c_x->e=ucx", "b->d=ucx")  # b->d already is ucx
    _, text = side_file(bundle, ".compose.yaml")
    data = yaml.safe_load(text)
    c_x = next(s for s in data["stages"] if s["name"] == "c_x")
    assert c_x["relay_to"]["e"] == {"options": {"copy_threads": 1}, "backend": "ucx"}
    only_no_op = gen(path, None, "b->d=ucx")
    assert [p.name for p in only_no_op.side_files] == ["pipeline.prometheus.yml"]


def test_edge_relay_partially_splits_the_ipc_group(tmp_path: Path) -> None:
    bundle = gen(split_pipeline(tmp_path), None, "b->c_x=nixl")
    assert ipc_of(bundle) == {"c-x": "shareable", "e": "service:c-x"}


def test_replicas_become_one_service_each(tmp_path: Path) -> None:
    path = small_pipeline(tmp_path, chain("src", "work", "sink"))
    data = yaml.safe_load(path.read_text())
    data["stages"][1]["replicas"] = 2
    path.write_text(yaml.safe_dump(data))
    bundle = gen(path, None)
    svc = services(bundle)
    assert list(svc)[1:5] == ["src", "work-0", "work-1", "sink"]
    for r in (0, 1):
        cmd = svc[f"work-{r}"]["command"]
        assert flag(cmd, "--stage") == "work"
        assert flag(cmd, "--advertise") == f"work-{r}:50051"
        assert flag(cmd, "--shm-prefix") == f"omnirail-work-{r}"
    assert ipc_of(bundle) == {
        "src": "shareable",
        "work-0": "service:src",
        "work-1": "service:src",
        "sink": "service:src",
    }
    assert "work-1:9464" in prometheus_targets(bundle)


def test_gpus_inline_and_options(tmp_path: Path) -> None:
    stages = chain("a", "b")
    stages[0]["gpu"] = 1
    path = small_pipeline(tmp_path, stages, relay={"backend": "inline"})
    bundle = gen(
        path,
        None,
        image="reg/omni:1",
        jaeger_image="j:1",
        prometheus_image="p:1",
        coordinator_port=6001,
        depends_condition="service_healthy",
    )
    svc = services(bundle)
    assert ipc_of(bundle) == {}  # inline edges need nothing
    device = svc["a"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device == {"driver": "nvidia", "device_ids": ["1"], "capabilities": ["gpu"]}
    assert "deploy" not in svc["b"]
    assert svc["a"]["image"] == "reg/omni:1" and svc["coordinator"]["image"] == "reg/omni:1"
    assert (svc["jaeger"]["image"], svc["prometheus"]["image"]) == ("j:1", "p:1")
    assert svc["coordinator"]["ports"] == ["6001:50051"]
    assert svc["b"]["depends_on"] == {"coordinator": {"condition": "service_healthy"}}
    assert "--depends-condition service_healthy" in bundle.text.splitlines()[2]


def test_python_pipeline_with_edge_relay_is_derived_as_yaml(tmp_path: Path) -> None:
    mod = f"compose_py_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text("def make(**kw):\n    return kw\n")
    stages = [{**s, "factory": f"{mod}:make"} for s in chain("a", "b")]
    (tmp_path / "pipe.py").write_text(f"pipeline = {{'name': 'py', 'stages': {stages!r}}}\n")
    bundle = gen(tmp_path / "pipe.py", None, "a->b=ucx")
    derived, text = side_file(bundle, ".compose.yaml")
    assert derived.name == "pipe.compose.yaml"
    derived.write_text(text)
    assert load_pipeline(derived).relay_for("a", "b").backend == "ucx"


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edge", "message"),
    [
        ("a-b=ucx", "expected SRC->DST=BACKEND"),
        ("a->b", "expected SRC->DST=BACKEND"),
        ("a->zz=ucx", "--edge-relay a->zz=ucx: unknown stage 'zz' (stages: a, b, c_x, d, e)"),
        ("a->e=ucx", "--edge-relay a->e=ucx: a has no edge to e (a sends to: b)"),
        ("b->d=rdma", "unknown relay backend 'rdma' (known: inline, nixl, shm, torchdist, ucx)"),
        ("a->b=ucx", "both stages run in process 'front_end' (one container)"),
        (
            "d->e=torchdist",
            "with --edge-relay d->e=torchdist the pipeline is invalid: stages[d].relay.rank",
        ),
    ],
)
def test_bad_edge_relays_are_named(tmp_path: Path, edge: str, message: str) -> None:
    path = split_pipeline(tmp_path)
    with pytest.raises(ComposeError) as info:
        gen(path, None, edge)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_an_edge_given_twice_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ComposeError, match="b->c_x=nixl: that edge is given twice"):
        gen(split_pipeline(tmp_path), None, "b->c_x=ucx", "b->c_x=nixl")


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (chain("a_b", "a-b"), "process 'a-b' and process 'a_b' both map to compose service 'a-b'"),
        (chain("src", "Jaeger"), "process 'Jaeger' and the jaeger service both map"),
        (chain("src", "coordinator"), "the coordinator service both map"),
        (chain("src", "bad_"), "'bad_' cannot be a compose service name"),
    ],
)
def test_service_name_collisions_fail(tmp_path: Path, stages: list, message: str) -> None:
    with pytest.raises(ComposeError) as info:
        gen(small_pipeline(tmp_path, stages), None)
    assert message in str(info.value)


def test_nothing_is_written_when_the_output_directory_is_missing(tmp_path: Path) -> None:
    path = split_pipeline(tmp_path)
    with pytest.raises(ComposeError, match="does not exist"):
        gen(path, tmp_path / "nope" / "c.yml", "b->c_x=ucx")
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".py") == ["pipeline.yaml"]


def test_a_bad_pipeline_fails_with_the_loader_message(tmp_path: Path) -> None:
    path = small_pipeline(tmp_path, [{"name": "a", "next": "ghost"}])
    with pytest.raises(ConfigError, match=r"stages\[a\]\.next: unknown stage 'ghost'"):
        gen(path, None)


# -- the command line and docker-compose -------------------------------------------------------


def omnirail(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnirail", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_cli_writes_the_files_and_reports_errors_in_one_line(tmp_path: Path) -> None:
    path = split_pipeline(tmp_path)
    out = tmp_path / "deploy" / "docker-compose.yml"
    out.parent.mkdir()
    ok = omnirail("compose", str(path), "-o", str(out), "--edge-relay", "b->c_x=ucx", cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == ""
    compose = yaml.safe_load(out.read_text())
    assert compose["services"]["c-x"]["volumes"][0]["source"] == ".."
    assert (tmp_path / "pipeline.compose.yaml").is_file()
    assert "omnirail compose ../pipeline.yaml -o docker-compose.yml" in out.read_text()
    # The command in the header, run where it says, makes the same file.
    again = omnirail("compose", "../pipeline.yaml", "--edge-relay", "b->c_x=ucx", cwd=out.parent)
    assert again.returncode == 0, again.stderr
    assert yaml.safe_load(again.stdout) == compose

    for args, message in [
        (["--edge-relay", "b-c_x"], "expected SRC->DST=BACKEND"),
        (["--edge-relay", "b->q=ucx"], "unknown stage 'q'"),
        (["-o", str(tmp_path / "missing" / "x.yml")], "does not exist"),
    ]:
        bad = omnirail("compose", str(path), *args, cwd=REPO)
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.startswith("error: ") and message in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not on PATH")
@pytest.mark.parametrize("edges", [(), ("b->c_x=ucx",)])
def test_docker_compose_accepts_the_output(tmp_path: Path, edges: tuple[str, ...]) -> None:
    stages = {"c_x": {"gpu": 0}, "d": {"replicas": 2}}
    bundle = gen(
        split_pipeline(tmp_path, **stages), tmp_path / "dc.yml", *edges, build_context=REPO
    )
    write_bundle(bundle)
    check = subprocess.run(
        ["docker-compose", "-f", str(tmp_path / "dc.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr


def test_compose_modules_import_without_torch() -> None:
    probe = (
        "import json, sys\n"
        "import omnirail.ops.compose, omnirail.ops.compose_edges, omnirail.ops.compose_groups\n"
        "import omnirail.ops.compose_models\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_committed_docker_compose_yml_is_what_its_command_makes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The top-level docker-compose.yml and its side files match a fresh generation."""
    committed = (REPO / "docker-compose.yml").read_text()
    command = committed.splitlines()[2].removeprefix("#   omnirail compose ").split()
    assert command[:3] == ["examples/omni_demo/pipeline.yaml", "-o", "docker-compose.yml"]
    edges = [e.strip("'") for flag, e in zip(command[3::2], command[4::2], strict=True)]
    assert set(command[3::2]) == {"--edge-relay"}
    monkeypatch.chdir(REPO)
    bundle = gen(Path(command[0]), Path(command[2]), *edges, build_context=REPO)
    stale = "stale: run the command in its header to regenerate"
    assert bundle.text == committed, stale
    for path, text in bundle.side_files.items():
        assert path.read_text() == text, f"{path} is {stale}"


# -- model directories --------------------------------------------------------------------------


def model_dir(path: Path) -> Path:
    """A stand-in for a Hugging Face directory: compose only mounts it."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3_omni_moe"}')
    return path


def model_bind(source: str | Path, target: str = "/model") -> dict[str, Any]:
    return {"type": "bind", "source": str(source), "target": target, "read_only": True}


def stage_services_of(bundle: ComposeBundle) -> list[str]:
    return [n for n in services(bundle) if n not in FIXED]


def derived_data(bundle: ComposeBundle) -> dict[str, Any]:
    _, text = side_file(bundle, ".compose.yaml")
    return yaml.safe_load(text)


def test_qwen3_omni_stages_mount_the_model_dir_read_only(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "Qwen3-Omni")
    out = tmp_path / "docker-compose.yml"
    bundle = gen(QWEN3_OMNI, out, model_dirs=(ModelDir(str(model)),))
    svc = services(bundle)
    stage_services = stage_services_of(bundle)
    served = {s for n in stage_services for s in flag(svc[n]["command"], "--stage").split(",")}
    assert served == {s["name"] for s in yaml.safe_load(QWEN3_OMNI.read_text())["stages"]}
    pipeline_mount = {
        "type": "bind",
        "source": os.path.relpath(QWEN3_OMNI.parent, tmp_path),
        "target": "/pipeline",
        "read_only": True,
    }
    for name in stage_services:
        assert svc[name]["volumes"] == [pipeline_mount, model_bind(model)], name
        assert flag(svc[name]["command"], "--pipeline") == "/pipeline/pipeline.compose.yaml"
    # The coordinator imports the factories but never reads the weights.
    assert svc["coordinator"]["volumes"] == [pipeline_mount]
    assert flag(svc["coordinator"]["command"], "--pipeline") == "/pipeline/pipeline.compose.yaml"

    # The containers' pipeline is the authored one with model_path at the mount.
    path, text = side_file(bundle, ".compose.yaml")
    assert path == QWEN3_OMNI.parent / "pipeline.compose.yaml"
    assert text.startswith(
        "# Derived from pipeline.yaml by `omnirail compose` (model_path -> /model);"
    )
    authored = yaml.safe_load(QWEN3_OMNI.read_text())
    assert derived_data(bundle) == {**authored, "model_path": "/model"}
    cfg = PipelineConfig.from_dict(derived_data(bundle), source_dir=str(QWEN3_OMNI.parent))
    assert {cfg.factory_args_for(s.name)["model_path"] for s in cfg.stages} == {"/model"}
    assert bundle.text.splitlines()[2].endswith(f"--model-dir {model}")


def test_a_missing_model_dir_is_an_error_naming_the_field(tmp_path: Path) -> None:
    written = yaml.safe_load(QWEN3_OMNI.read_text())["model_path"]
    if Path(written).exists():
        pytest.skip(f"{written} exists on this host")
    with pytest.raises(ComposeError) as info:
        gen(QWEN3_OMNI, None, resolve=False)
    assert str(info.value) == (
        f"model_path {written!r}: no such directory on this host; pass --model-dir HOST_DIR "
        "where it is, or --no-check-model-dir if it will exist where the containers run"
    )
    missing = tmp_path / "nope"
    with pytest.raises(ComposeError) as info:
        gen(QWEN3_OMNI, None, resolve=False, model_dirs=(ModelDir(str(missing)),))
    assert str(info.value) == (
        f"--model-dir {missing} (for model_path): no such directory on this host; "
        "pass --no-check-model-dir if it will exist where the containers run"
    )
    (tmp_path / "file").write_text("")
    with pytest.raises(ComposeError, match=r"\(for model_path\): not a directory"):
        gen(QWEN3_OMNI, None, resolve=False, model_dirs=(ModelDir(str(tmp_path / "file")),))


def test_no_check_model_dir_mounts_the_path_as_written(tmp_path: Path) -> None:
    written = yaml.safe_load(QWEN3_OMNI.read_text())["model_path"]
    bundle = gen(QWEN3_OMNI, None, resolve=False, check_model_dirs=False)
    svc = services(bundle)
    assert all(svc[n]["volumes"][1:] == [model_bind(written)] for n in stage_services_of(bundle))
    assert bundle.text.splitlines()[2].endswith("--no-resolve --no-check-model-dir")
    # Another host's directory, said to exist there.
    bundle = gen(
        QWEN3_OMNI,
        None,
        resolve=False,
        check_model_dirs=False,
        model_dirs=(ModelDir("/srv/models/qwen3-omni"),),
    )
    assert services(bundle)["thinker"]["volumes"][1] == model_bind("/srv/models/qwen3-omni")
    assert derived_data(bundle)["model_path"] == "/model"


def test_a_relative_model_path_starts_at_the_pipeline_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No name: it defaults to model_path, and the derived pipeline must keep it.
    path = small_pipeline(tmp_path, chain("a", "b"), "make_model", model_path="weights/tiny")
    data = yaml.safe_load(path.read_text())
    del data["name"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    model_dir(tmp_path / "weights" / "tiny")
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    monkeypatch.chdir(deploy)  # not where the model is
    bundle = gen(path, deploy / "dc.yml")
    for name in ("a", "b"):
        assert services(bundle)[name]["volumes"][1] == model_bind("../weights/tiny")
    derived = derived_data(bundle)
    assert (derived["name"], derived["model_path"]) == ("weights/tiny", "/model")

    (tmp_path / "weights" / "tiny").rename(tmp_path / "weights" / "gone")
    with pytest.raises(ComposeError) as info:
        gen(path, None)
    assert str(info.value).startswith(
        f"model_path 'weights/tiny' ({tmp_path / 'weights/tiny'}: a relative model_path starts "
        "at the pipeline's directory): no such directory on this host"
    )


def test_stage_model_paths_each_get_a_mount_where_they_are_read(tmp_path: Path) -> None:
    base, other, late = (model_dir(tmp_path / n) for n in ("base", "other", "late"))
    stages = chain("a", "b", "c", "d")
    stages[1]["factory_args"] = {"model_path": str(other), "size": 2}
    stages[2]["factory_args"] = {"model_path": "/not/read"}  # runtime_overrides wins
    stages[3]["process"] = "a"  # a's service reads both a's and d's
    overrides = {"c": {"model_path": str(late)}, "d": {"model_path": str(other)}}
    path = small_pipeline(
        tmp_path, stages, "make_model", model_path=str(base), runtime_overrides=overrides
    )
    bundle = gen(path, None)
    svc = services(bundle)
    assert [v["target"] for v in svc["a"]["volumes"]] == ["/pipeline", "/model", "/model-2"]
    assert svc["a"]["volumes"][1:] == [model_bind(base), model_bind(other, "/model-2")]
    assert svc["b"]["volumes"][1:] == [model_bind(other, "/model-2")]
    assert svc["c"]["volumes"][1:] == [model_bind(late, "/model-3")]
    derived = derived_data(bundle)
    assert derived["model_path"] == "/model"
    assert derived["stages"][1]["factory_args"] == {"model_path": "/model-2", "size": 2}
    assert derived["stages"][2]["factory_args"] == {"model_path": "/not/read"}
    assert derived["runtime_overrides"] == {
        "c": {"model_path": "/model-3"},
        "d": {"model_path": "/model-2"},
    }
    _, text = side_file(bundle, ".compose.yaml")
    assert text.splitlines()[0] == (
        "# Derived from small.yaml by `omnirail compose` (model_path -> /model; "
        "stages[b].factory_args.model_path, runtime_overrides[d].model_path -> /model-2; "
        "runtime_overrides[c].model_path -> /model-3); edit small.yaml, not this file."
    )

    # Several directories: --model-dir says which one it replaces.
    moved = model_dir(tmp_path / "moved")
    keyed = gen(path, None, model_dirs=(ModelDir.parse(f"{late}={moved}"),))
    assert services(keyed)["c"]["volumes"][1:] == [model_bind(moved, "/model-3")]
    with pytest.raises(ComposeError) as info:
        gen(path, None, model_dirs=(ModelDir(str(moved)),))
    assert "the stages read 3 model directories" in str(info.value)
    assert str(info.value).endswith("say which: --model-dir MODEL_PATH=HOST_DIR")
    with pytest.raises(ComposeError, match=r"no stage reads model_path '/not/read' \(read: "):
        gen(path, None, model_dirs=(ModelDir.parse(f"/not/read={moved}"),))
    with pytest.raises(ComposeError, match="is given a host directory twice"):
        gen(path, None, model_dirs=(ModelDir(str(moved), str(late)),) * 2)
    late.rename(tmp_path / "gone")
    with pytest.raises(ComposeError) as info:
        gen(path, None)
    assert str(info.value) == (
        f"runtime_overrides[c].model_path {str(late)!r}: no such directory on this host; pass "
        f"--model-dir {late}=HOST_DIR where it is, or --no-check-model-dir if it will exist "
        "where the containers run"
    )


def test_a_model_path_no_factory_takes_is_not_mounted(tmp_path: Path) -> None:
    # A label (the pipeline's name defaults to it): factories without a model_path
    # parameter are not given it, so compose neither mounts nor checks it.
    path = small_pipeline(tmp_path, chain("a", "b"), model_path="org/some-model")
    bundle = gen(path, None)
    assert all(len(services(bundle)[n]["volumes"]) == 1 for n in ("a", "b"))
    assert [p.name for p in bundle.side_files] == ["small.prometheus.yml"]
    # Without importing the factories compose cannot tell, and takes every stage to read it.
    with pytest.raises(ComposeError, match=r"model_path 'org/some-model' .*no such directory"):
        gen(path, None, resolve=False)


def test_model_dir_flag_errors(tmp_path: Path) -> None:
    path = small_pipeline(tmp_path, chain("a", "b"))
    with pytest.raises(ComposeError, match="--model-dir /x: no stage of the pipeline reads a"):
        gen(path, None, model_dirs=(ModelDir("/x"),))
    for text in ("a=", "=b", ""):
        with pytest.raises(ComposeError, match="expected HOST_DIR or MODEL_PATH=HOST_DIR"):
            ModelDir.parse(text)


def test_a_hugging_face_cache_snapshot_is_refused(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub/models--q/snapshots/abc"
    snapshot.mkdir(parents=True)
    blob = tmp_path / "hub/models--q/blobs/123"
    blob.parent.mkdir()
    blob.write_text("{}")
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    path = small_pipeline(tmp_path, chain("a", "b"), "make_model", model_path=str(snapshot))
    with pytest.raises(ComposeError) as info:
        gen(path, None)
    assert f"config.json links to {blob}, outside the directory" in str(info.value)
    assert "`hf download --local-dir`" in str(info.value)
    assert services(gen(path, None, check_model_dirs=False))["a"]["volumes"][1] == model_bind(
        snapshot
    )


def test_cli_model_dir(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "m")
    path = small_pipeline(tmp_path, chain("a", "b"), "make_model", model_path="/absent/model")
    ok = omnirail("compose", str(path), "--model-dir", "m", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    compose = yaml.safe_load(ok.stdout)
    assert compose["services"]["b"]["volumes"][1] == model_bind("./m")
    assert "omnirail compose small.yaml --model-dir m\n" in ok.stdout
    assert yaml.safe_load((tmp_path / "small.compose.yaml").read_text())["model_path"] == "/model"
    bad = omnirail("compose", str(path), cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "error: model_path '/absent/model': no such directory on this host; pass --model-dir "
        "HOST_DIR where it is, or --no-check-model-dir if it will exist where the containers run"
    )
    unchecked = omnirail("compose", str(path), "--no-check-model-dir", cwd=tmp_path)
    assert unchecked.returncode == 0, unchecked.stderr
    volumes = yaml.safe_load(unchecked.stdout)["services"]["a"]["volumes"]
    assert volumes[1] == model_bind("/absent/model")
    assert f"--model-dir {model.name}" not in unchecked.stdout


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not on PATH")
def test_docker_compose_accepts_model_mounts(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "model")
    bundle = gen(QWEN3_OMNI, tmp_path / "dc.yml", resolve=False, model_dirs=(ModelDir(str(model)),))
    (tmp_path / "dc.yml").write_text(bundle.text)  # the side files are not needed to check it
    check = subprocess.run(
        ["docker-compose", "-f", str(tmp_path / "dc.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    thinker = yaml.safe_load(check.stdout)["services"]["thinker"]
    assert model_bind(model) in thinker["volumes"]
