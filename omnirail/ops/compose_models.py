"""Model directories in a compose deployment: every `model_path` a stage reads becomes a
read-only bind mount at a fixed container path, and the derived pipeline points there.

A stage reads `runtime_overrides[stage].model_path` if set, else its
`factory_args.model_path`, else the pipeline's `model_path` if its factory takes one
(`factory_args_for`; without `resolve` the factories are not imported, and every stage is
taken to read it). Each
distinct host directory among those is mounted once per service whose stages read it: the
first at `/model`, any others at `/model-2`, `/model-3`, ... A fixed path keeps the image's
own directories from being shadowed and gives the same container path wherever the model
lies on the host. A relative `model_path` starts at the pipeline file's directory (the
containers' working directory is the image's). `--model-dir [MODEL_PATH=]HOST_DIR` mounts
another host directory; every host directory must exist at generation time unless
`check` is off (`--no-check-model-dir`), so no compose file binds a path that is not there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnirail.config import PipelineConfig
from omnirail.ops.compose_groups import ComposeError

MODEL_MOUNT = "/model"
# The image's user and group (the Dockerfile's `USER 10001:10001`): who reads the mount.
IMAGE_UID = IMAGE_GID = 10001
_KEY = "model_path"
_UNCHECKED_HINT = "--no-check-model-dir if it will exist where the containers run"


@dataclass(frozen=True)
class ModelDir:
    """`--model-dir [MODEL_PATH=]HOST_DIR`: where a model directory the pipeline names
    lies on the host. `written` is the `model_path` as the pipeline writes it; None: the
    pipeline's only one."""

    host: str  # as given: relative paths start at the working directory
    written: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelDir:
        written, sep, host = text.partition("=")
        if not sep:
            written, host = "", text
        if not host or (sep and not written):
            raise ComposeError(f"--model-dir {text!r}: expected HOST_DIR or MODEL_PATH=HOST_DIR")
        return cls(host, written or None)

    def __str__(self) -> str:
        return self.host if self.written is None else f"{self.written}={self.host}"


@dataclass(frozen=True)
class Read:
    """Stage `stage` reads the model directory `value` through config field `field`."""

    stage: str
    field: str  # model_path, stages[S].factory_args.model_path, runtime_overrides[S].model_path
    value: str  # as written


@dataclass(frozen=True)
class ModelMount:
    """One host directory, mounted read-only at `target` in the services of its readers."""

    host: Path  # absolute
    given: str  # the host path as written (pipeline or flag): absolute stays absolute
    target: str
    reads: tuple[Read, ...]
    flag: ModelDir | None = None  # the --model-dir that chose `host`

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(r.stage for r in self.reads)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.field for r in self.reads))


def model_reads(cfg: PipelineConfig, resolve: bool) -> list[Read]:
    """The `model_path` each stage reads, for the stages that read one (module docstring)."""
    out: list[Read] = []
    for stage in cfg.stages:
        override = cfg.runtime_overrides.get(stage.name, {})
        if _KEY in override:
            field, value = f"runtime_overrides[{stage.name}].{_KEY}", override[_KEY]
        elif _KEY in stage.factory_args:
            field, value = f"stages[{stage.name}].factory_args.{_KEY}", stage.factory_args[_KEY]
        elif resolve and _KEY not in cfg.factory_args_for(stage.name):
            continue  # its factory takes no model_path: the pipeline's is not passed
        else:
            field, value = _KEY, cfg.model_path
        # Anything else (None: the factory's default) is not a path compose can mount.
        if isinstance(value, str) and value:
            out.append(Read(stage.name, field, value))
    return out


def model_mounts(
    cfg: PipelineConfig,
    pipeline_dir: Path,
    model_dirs: tuple[ModelDir, ...],
    check: bool,
    resolve: bool,
) -> list[ModelMount]:
    """The mounts for the model directories the stages read, checked (module docstring)."""
    reads = model_reads(cfg, resolve)
    written = list(dict.fromkeys(r.value for r in reads))
    hosts = _host_dirs(written, pipeline_dir, model_dirs)
    by_host: dict[Path, list[Read]] = {}
    for read in reads:
        by_host.setdefault(hosts[read.value][0], []).append(read)
    mounts = []
    for i, (host, mine) in enumerate(by_host.items()):
        flag = hosts[mine[0].value][1]
        given = mine[0].value if flag is None else flag.host
        target = MODEL_MOUNT if i == 0 else f"{MODEL_MOUNT}-{i + 1}"
        mounts.append(ModelMount(host, given, target, tuple(mine), flag))
    if check:
        for mount in mounts:
            _check_dir(mount, several=len(written) > 1)
    return mounts


def point_at_mounts(data: dict[str, Any], cfg: PipelineConfig, mounts: list[ModelMount]) -> None:
    """Rewrites, in the authored pipeline `data`, every model_path field a stage reads to
    its container path. The pipeline keeps its name, which defaults to `model_path`."""
    if not mounts:
        return
    if data.get("name") is None:
        data["name"] = cfg.name
    stages = {s["name"]: s for s in data["stages"]}
    for mount in mounts:
        for read in mount.reads:
            if read.field == _KEY:
                data[_KEY] = mount.target
            elif read.field.startswith("runtime_overrides["):
                overrides = data["runtime_overrides"]
                overrides[read.stage] = {**overrides[read.stage], _KEY: mount.target}
            else:
                stage = stages[read.stage]
                stage["factory_args"] = {**stage["factory_args"], _KEY: mount.target}


def header_args(model_dirs: tuple[ModelDir, ...], check: bool, base: Path) -> list[str]:
    """The flags that remake these options, with relative host paths from `base`."""
    args: list[str] = []
    for d in sorted(model_dirs, key=str):
        host = d.host if os.path.isabs(d.host) else os.path.relpath(Path(d.host).resolve(), base)
        args += ["--model-dir", str(ModelDir(host, d.written))]
    return args if check else [*args, "--no-check-model-dir"]


def _host_dirs(
    written: list[str], pipeline_dir: Path, model_dirs: tuple[ModelDir, ...]
) -> dict[str, tuple[Path, ModelDir | None]]:
    """model_path value -> (absolute host directory, the --model-dir that chose it)."""
    chosen: dict[str, ModelDir] = {}
    for d in model_dirs:
        if not written:
            raise ComposeError(f"--model-dir {d}: no stage of the pipeline reads a model_path")
        if d.written is None and len(written) > 1:
            names = ", ".join(repr(w) for w in written)
            raise ComposeError(
                f"--model-dir {d}: the stages read {len(written)} model directories ({names}); "
                "say which: --model-dir MODEL_PATH=HOST_DIR"
            )
        key = written[0] if d.written is None else d.written
        if key not in written:
            names = ", ".join(repr(w) for w in written)
            raise ComposeError(
                f"--model-dir {d}: no stage reads model_path {key!r} (read: {names})"
            )
        if key in chosen:
            raise ComposeError(
                f"--model-dir {d}: model_path {key!r} is given a host directory twice"
            )
        chosen[key] = d
    out: dict[str, tuple[Path, ModelDir | None]] = {}
    for value in written:
        flag = chosen.get(value)
        if flag is not None:
            out[value] = (Path(flag.host).resolve(), flag)
        else:
            out[value] = ((pipeline_dir / value).resolve(), None)  # absolute stays absolute
    return out


def _check_dir(mount: ModelMount, several: bool) -> None:
    fields = " and ".join(mount.fields)
    if mount.flag is not None:
        what = f"--model-dir {mount.flag} (for {fields})"
        hint = f"pass {_UNCHECKED_HINT}"
    else:
        what = f"{fields} {mount.given!r}"
        if not os.path.isabs(mount.given):
            what += f" ({mount.host}: a relative model_path starts at the pipeline's directory)"
        flag = f"--model-dir {mount.given}=HOST_DIR" if several else "--model-dir HOST_DIR"
        hint = f"pass {flag} where it is, or {_UNCHECKED_HINT}"
    if not mount.host.exists():
        raise ComposeError(f"{what}: no such directory on this host; {hint}")
    if not mount.host.is_dir():
        raise ComposeError(f"{what}: not a directory; {hint}")
    # A Hugging Face cache snapshot holds symlinks into ../../blobs: inside the container,
    # which sees the directory alone, they would dangle.
    for entry in sorted(mount.host.iterdir()):
        if entry.is_symlink() and not entry.resolve().is_relative_to(mount.host):
            raise ComposeError(
                f"{what}: {entry.name} links to {entry.resolve()}, outside the directory, "
                "which the container will not see; mount a directory holding the files "
                f"themselves (e.g. `hf download --local-dir`), or pass {_UNCHECKED_HINT}"
            )
    _check_readable(mount.host, what)


def _check_readable(root: Path, what: str) -> None:
    """Every file (and folder) under `root` readable by the image's user, who owns none
    of them: `save_pretrained` writes safetensors shards 0600, which the stages would
    fail to open only once they start, far from the cause."""
    for path in [root, *sorted(root.rglob("*"))]:
        if path.is_symlink():
            continue
        st = path.stat()
        need = 0o5 if path.is_dir() else 0o4  # read (and, for a folder, enter)
        if st.st_uid == IMAGE_UID:
            ok = (st.st_mode >> 6) & need == need
        elif st.st_gid == IMAGE_GID:
            ok = (st.st_mode >> 3) & need == need
        else:
            ok = st.st_mode & need == need
        if not ok:
            name = path.relative_to(root) if path != root else path
            raise ComposeError(
                f"{what}: {name} (mode {st.st_mode & 0o777:04o}, owner uid {st.st_uid}) is not "
                f"readable by the image's user (uid {IMAGE_UID}); run `chmod -R a+rX "
                f"{root}`, or pass {_UNCHECKED_HINT}"
            )
