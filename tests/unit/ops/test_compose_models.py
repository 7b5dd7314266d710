"""`omnirail compose` and model directories: read-only mounts where stages read them, the
derived pipeline pointing there, and the errors (omnirail.ops.compose_models)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnirail.config import PipelineConfig
from omnirail.ops.compose import ComposeBundle, ComposeError, ModelDir
from tests.unit.ops.compose_helpers import (
    FIXED,
    GATEWAY,
    QWEN3_OMNI,
    chain,
    flag,
    gen,
    omnirail,
    services,
    side_file,
    small_pipeline,
)


def model_dir(path: Path) -> Path:
    """A stand-in for a Hugging Face directory: compose only mounts it."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3_omni_moe"}')
    return path


def model_bind(source: str | Path, target: str = "/model") -> dict[str, Any]:
    return {"type": "bind", "source": str(source), "target": target, "read_only": True}


def stage_services_of(bundle: ComposeBundle) -> list[str]:
    return [n for n in services(bundle) if n not in FIXED and n != GATEWAY]


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


def test_files_the_image_user_cannot_read_are_refused(tmp_path: Path) -> None:
    """`save_pretrained` writes shards 0600: the image's user (uid 10001) could not open
    them, and the stages would fail only once started. Compose names the file and the fix."""
    model = model_dir(tmp_path / "m")
    shard = model / "model-00001-of-00002.safetensors"
    shard.write_bytes(b"")
    path = small_pipeline(tmp_path, chain("a", "b"), "make_model", model_path=str(model))
    for mode, readable in ((0o600, False), (0o640, False), (0o644, True)):
        shard.chmod(mode)
        if readable:
            gen(path, None)
            continue
        with pytest.raises(ComposeError) as info:
            gen(path, None)
        assert str(info.value) == (
            f"model_path {str(model)!r}: model-00001-of-00002.safetensors (mode {mode:04o}, "
            f"owner uid {os.getuid()}) is not readable by the image's user (uid 10001); run "
            f"`chmod -R a+rX {model}`, or pass --no-check-model-dir if it will exist where "
            "the containers run"
        )
    (model / "sub").mkdir(mode=0o700)
    with pytest.raises(ComposeError, match=r": sub \(mode 0700"):
        gen(path, None)
    assert services(gen(path, None, check_model_dirs=False))["a"]["volumes"][1] == model_bind(model)


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
