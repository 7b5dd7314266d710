"""`omnirail compose`: services, IPC namespaces, derived pipelines, side files and errors."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from omnirail.config import ConfigError, load_pipeline
from omnirail.ops.compose import (
    ComposeError,
    default_build_context,
    write_bundle,
)
from tests.unit.ops.compose_helpers import (
    FIXED,
    OTLP,
    QUICKSTART,
    REPO,
    STREAMING,
    chain,
    flag,
    gen,
    ipc_of,
    omnirail,
    prometheus_targets,
    services,
    side_file,
    small_pipeline,
    split_pipeline,
)


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
    # Stopped services drain for up to drain_s (10 s) before the runtime's SIGKILL.
    assert {n: s.get("stop_grace_period") for n, s in svc.items()} == {
        **{n: "15s" for n in ["coordinator", *stages]},
        **{n: None for n in FIXED[1:]},
    }
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
    ctx = default_build_context(out.parent)  # the default adds no flag to the command
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
    assert cfg.relay_for("b", "d").options == {"progress": "polling"}
    assert cfg.relay_for("d", "e").backend == "nixl"
    assert cfg.relay_for("a", "b").backend == "shm"
    assert yaml.safe_load(out.read_text()) == bundle.compose


def test_a_compose_file_that_cannot_be_written_leaves_nothing_written(tmp_path: Path) -> None:
    path = split_pipeline(tmp_path)
    (tmp_path / "gone").mkdir()
    before = sorted(tmp_path.iterdir())
    bundle = gen(path, tmp_path / "gone" / "docker-compose.yml", "b->c_x=ucx")
    (tmp_path / "gone").rmdir()  # between the checks and the writing
    before.remove(tmp_path / "gone")
    with pytest.raises(ComposeError, match=r"cannot write .*gone/docker-compose\.yml"):
        write_bundle(bundle)
    # Neither the side files beside the pipeline nor any temporary file.
    assert sorted(tmp_path.iterdir()) == before


def test_a_symlinked_compose_file_is_written_through(tmp_path: Path) -> None:
    path = split_pipeline(tmp_path)
    real = tmp_path / "deploy" / "compose.yml"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "docker-compose.yml"
    link.symlink_to(real)
    bundle = gen(path, link)
    write_bundle(bundle)
    assert link.is_symlink() and yaml.safe_load(real.read_text()) == bundle.compose
    assert not [p for p in real.parent.iterdir() if p.name.endswith(".tmp")]


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
    # The container sees its one GPU as device 0; the stage maps config id 1 through this.
    assert svc["a"]["environment"]["OMNIRAIL_GPUS"] == "1"
    assert "deploy" not in svc["b"] and "OMNIRAIL_GPUS" not in svc["b"]["environment"]
    # Stages restart on failure, as many times as `restart.max` allows (default 5).
    assert svc["a"]["restart"] == svc["b"]["restart"] == "on-failure:5"
    assert "restart" not in svc["coordinator"]
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
    # The command in the header, run where it says, makes the same file (it names the
    # checkout it was made in as the build context: the default only in that checkout).
    made = out.read_text()
    command = shlex.split(made.splitlines()[2].removeprefix("#   "))
    assert "--build-context" in command
    again = omnirail(*command[1:], cwd=out.parent)
    assert again.returncode == 0, again.stderr
    assert out.read_text() == made

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
