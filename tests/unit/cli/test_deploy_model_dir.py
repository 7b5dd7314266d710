"""`omnirail compose MODEL_DIR` and `omnirail k8s MODEL_DIR`: a checkpoint directory taken as
`omnirail serve` takes it. The tiny Qwen3-Omni checkpoint (made here, never downloaded)
gives a compose file whose model stages bind it read-only at /model, and manifests that
mount the claim holding it there, both over the installed pipeline (the model code is in
the image). What `serve` refuses, they refuse the same way, in one line, writing nothing."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from omnirail.cli.commands import main
from omnirail.config import load_pipeline
from omnirail.ops.k8s import K8sBundle
from tests.unit.models.test_registry import QWEN, checkpoint
from tests.unit.ops.test_k8s import _check_wiring, _validate

pytest.importorskip("transformers")
STAGES = ["preprocessing", "image_encoder", "audio_encoder", "thinker", "decode", "talker"]
STAGES += ["code2wav"]  # every one reads the checkpoint (weights, tokenizer or processor)
PACKAGE = "omnirail.models.qwen3_omni."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnirail.testing.tiny import make

    folder = make("qwen3-omni", tmp_path_factory.mktemp("qwen3_omni") / "tiny")
    # save_pretrained writes the shards 0600: the image's user must be able to read them.
    subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    return folder


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def _stages(text: str) -> dict[str, dict]:
    return {s["name"]: s for s in yaml.safe_load(text)["stages"]}


def test_compose_of_a_checkpoint_mounts_it_and_runs_the_installed_pipeline(
    tiny: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "qwen.yml"
    argv = ["compose", str(tiny), "-o", str(out), "--build-context", "none"]
    argv += ["--set", "stages.talker.replicas=2"]
    code, err = _run(capsys, *argv)
    assert code == 0, err
    # The resolved pipeline, beside the compose file, in the folder the services mount.
    folder = tmp_path / "qwen3-omni"
    resolved = yaml.safe_load((folder / "pipeline.yaml").read_text())
    assert resolved["model_path"] == str(tiny)
    derived = (folder / "pipeline.compose.yaml").read_text()
    assert yaml.safe_load(derived)["model_path"] == "/model"
    for stage in _stages(derived).values():
        assert stage["factory"].startswith(PACKAGE), stage["factory"]
    load_pipeline(folder / "pipeline.compose.yaml")  # valid, every factory imported
    services = yaml.safe_load(out.read_text())["services"]
    assert {"talker-0", "talker-1"} <= set(services)
    model = {"type": "bind", "source": str(tiny), "target": "/model", "read_only": True}
    for name, service in services.items():
        if name in ("jaeger", "prometheus"):
            continue
        binds = {v["target"]: v for v in service["volumes"]}
        assert binds["/pipeline"]["source"] == "./qwen3-omni", name
        assert binds["/pipeline"]["read_only"] is True
        if name in ("coordinator", "gateway"):  # they import the factories, call none
            assert "/model" not in binds, name
        else:
            assert binds["/model"] == model, name
    stages = {n.replace("-", "_").removesuffix("_0").removesuffix("_1") for n in services}
    assert set(STAGES) <= stages
    # The header's command (run in the compose file's directory) remakes the same file.
    command = shlex.split(out.read_text().splitlines()[2].lstrip("# "))
    assert command[:3] == ["omnirail", "compose", str(tiny)]
    assert command[command.index("--set") + 1] == "stages.talker.replicas=2"
    assert command[command.index("-o") + 1] == out.name
    before = out.read_text()
    monkeypatch.chdir(out.parent)
    assert main(command[1:]) == 0
    assert out.read_text() == before


def test_k8s_of_a_checkpoint_mounts_the_claim_and_ships_only_the_pipeline(
    tiny: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "k8s"
    code, err = _run(capsys, "k8s", str(tiny), "-o", str(out), "--model-claim", "qwen-ckpt")
    assert code == 0, err
    text = (out / "omnirail.yaml").read_text()
    assert shlex.split(text.splitlines()[2].lstrip("# "))[2] == str(tiny)
    bundle = K8sBundle([d for d in yaml.safe_load_all(text) if d])
    _validate(bundle)
    (config_map,) = [o for o in bundle.manifests if o["kind"] == "ConfigMap"]
    assert list(config_map["data"]) == ["pipeline.yaml"]  # the model code is in the image
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(config_map["data"]["pipeline.yaml"])
    assert yaml.safe_load(pipeline.read_text())["model_path"] == "/model"
    _check_wiring(bundle, pipeline)
    mounted = 0
    for deployment in (o for o in bundle.manifests if o["kind"] == "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"]
                  if "persistentVolumeClaim" in v}  # fmt: skip
        for container in spec["containers"]:
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            if "/model" in mounts:
                mounted += 1
                assert mounts["/model"]["readOnly"] is True
                assert claims[mounts["/model"]["name"]]["claimName"] == "qwen-ckpt"
    assert mounted == len(STAGES)


def _bad_checkpoint(folder: Path, what: str) -> list[str]:
    """A checkpoint directory with `what` wrong; the flags that go with it."""
    folder.mkdir()
    if what == "architecture":
        checkpoint(folder, {"architectures": ["GPT2LMHeadModel"]})
    elif what == "missing-shard":
        checkpoint(folder, {"architectures": [QWEN]})
        (folder / "model-00001-of-00002.safetensors").unlink()
    elif what == "bad-set":
        checkpoint(folder, {"architectures": [QWEN]})
        return ["--set", "stages.vocoder.gpu=0"]
    return []  # no-config: an empty directory


@pytest.mark.parametrize("command", ["compose", "k8s"])
@pytest.mark.parametrize(
    ("what", "problem"),
    [
        ("architecture", "supported: qwen3-omni"),
        ("no-config", "config.json: not found"),
        ("missing-shard", "model-00001-of-00002.safetensors: missing"),
        ("bad-set", "--set 'stages.vocoder.gpu=0': no stage 'vocoder'"),
    ],
)
def test_what_serve_refuses_is_one_line_and_writes_nothing(
    command: str, what: str, problem: str, tmp_path: Path, capsys
) -> None:
    flags = _bad_checkpoint(tmp_path / "ckpt", what)
    work = tmp_path / "out"
    work.mkdir()
    out = work / ("dc.yml" if command == "compose" else "k8s")
    code, err = _run(capsys, command, str(tmp_path / "ckpt"), "-o", str(out), *flags)
    assert code == 2 and err.count("\n") == 1 and problem in err, err
    assert list(work.iterdir()) == []


def test_a_failed_compose_leaves_no_pipeline_behind(tiny: Path, tmp_path: Path, capsys) -> None:
    code, err = _run(
        capsys, "compose", str(tiny), "-o", str(tmp_path / "dc.yml"), "--coordinator-port", "0"
    )
    assert code == 2 and "--coordinator-port 0" in err, err
    assert list(tmp_path.iterdir()) == []


def test_set_goes_with_a_checkpoint_not_a_pipeline_file(tmp_path: Path, capsys) -> None:
    pipeline = Path(__file__).resolve().parents[3] / "examples/quickstart/pipeline.yaml"
    code, err = _run(
        capsys, "compose", str(pipeline), "-o", str(tmp_path / "dc.yml"), "--set", "name=x"
    )
    assert code == 2 and err.count("\n") == 1 and "--set goes with a checkpoint" in err
