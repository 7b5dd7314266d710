"""Where a stage process runs its stages: the GPU its config gives it (`gpu:`), or the CPU.

Two steps, because CUDA reads `CUDA_VISIBLE_DEVICES` once, when it initializes:

1. `narrow` (before anything touches CUDA): finds the process's GPU (a process holds
   stages of at most one GPU; a TP rank process, its rank's), checks the id against the
   GPUs this process may see, and sets `CUDA_VISIBLE_DEVICES` to that one device, so the
   process sees it as `cuda:0` and can touch no other.
2. `settle` (after torch is imported): the device the stages get, `cuda:0`, or, where
   the process sees no CUDA device, a start-up error naming the stage and field, unless
   the pipeline allows `cpu_fallback` (then `cpu`, with a warning).

GPU ids count among the GPUs the launcher's environment sees: `gpu: 1` under
`CUDA_VISIBLE_DEVICES=4,5` is device 5. Where a container runtime hands a process only
its reserved GPUs (`omnirail compose`), `OMNIRAIL_GPUS` lists the config ids of those,
in the order the process sees them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from omnirail.config import PipelineConfig

log = logging.getLogger(__name__)

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
# Config GPU ids of the devices a container sees, in order (set by `omnirail compose`).
GPUS_ENV = "OMNIRAIL_GPUS"
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


class PlacementError(ValueError):
    """A stage's placement cannot apply on this host (names the stage and field)."""


@dataclass(frozen=True)
class Asked:
    """The GPU a process's config gives it: which stage says so, and the id."""

    stage: str
    gpu: int

    @property
    def field(self) -> str:
        return f"stages[{self.stage}].gpu"


@dataclass(frozen=True)
class Placement:
    """What the process's stages run on. `gpu`: the config id (None on the CPU unless
    asked for); `fallback`: a GPU was asked for and the CPU is used instead."""

    device: str = "cpu"
    gpu: int | None = None
    fallback: bool = False


def asked_gpu(
    pipeline: PipelineConfig, stage_names: Iterable[str], tp_rank: int | None = None
) -> Asked | None:
    """The process's GPU from its stages' config (validation keeps a process to one)."""
    for name in stage_names:
        stage = pipeline.stage(name)
        gpus = stage.gpus
        if gpus:
            return Asked(name, gpus[tp_rank or 0] if stage.tp_size > 1 else gpus[0])
    return None


def host_gpu_count() -> int | None:
    """GPUs the NVIDIA driver shows this host (None without the driver)."""
    try:
        return sum(1 for _ in _NVIDIA_GPUS.iterdir())
    except OSError:
        return None


def _ids(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def narrow(
    asked: Asked | None,
    environ: MutableMapping[str, str],
    gpu_count: Callable[[], int | None] = host_gpu_count,
) -> None:
    """Sets `CUDA_VISIBLE_DEVICES` to the asked GPU alone; raises PlacementError for an
    id past what this process may see. Must run before CUDA initializes."""
    if asked is None:
        return
    gpu, at = asked.gpu, asked.field
    visible = environ.get(VISIBLE_ENV)
    reserved = environ.get(GPUS_ENV)
    if reserved is not None:
        ids = _ids(reserved)
        if str(gpu) not in ids:
            raise PlacementError(
                f"{at}: GPU {gpu} is not among the GPUs this container was given "
                f"({GPUS_ENV}={reserved!r})"
            )
        index = ids.index(str(gpu))
        devices = _ids(visible) if visible else [str(i) for i in range(len(ids))]
        if index >= len(devices):
            raise PlacementError(
                f"{at}: GPU {gpu} is device {index} of this container, past the "
                f"{len(devices)} it sees ({VISIBLE_ENV}={visible!r})"
            )
        environ[VISIBLE_ENV] = devices[index]
        return
    if visible is not None:
        devices = _ids(visible)
        if gpu >= len(devices):
            raise PlacementError(
                f"{at}: GPU {gpu} is past the {len(devices)} visible GPU(s) "
                f"({VISIBLE_ENV}={visible!r}; ids count from 0 among those)"
            )
        environ[VISIBLE_ENV] = devices[gpu]
        return
    count = gpu_count()
    if count is not None and gpu >= count:
        raise PlacementError(f"{at}: GPU {gpu} is past the {count} GPU(s) of this host")
    environ[VISIBLE_ENV] = str(gpu)


def settle(
    pipeline: PipelineConfig,
    asked: Asked | None,
    environ: MutableMapping[str, str],
) -> Placement:
    """The device of the process's stages, once torch is importable (after `narrow`)."""
    if asked is None:
        return Placement()
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        torch.cuda.set_device(0)
        return Placement("cuda:0", asked.gpu)
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is built without CUDA"
    else:
        why = f"no usable NVIDIA driver or device ({VISIBLE_ENV}={environ.get(VISIBLE_ENV)!r})"
    if pipeline.cpu_fallback:
        log.warning(
            "%s: GPU %d asked for, but %s; running on the CPU (cpu_fallback)",
            asked.field,
            asked.gpu,
            why,
        )
        return Placement("cpu", asked.gpu, fallback=True)
    raise PlacementError(
        f"{asked.field}: GPU {asked.gpu} asked for, but this process sees no CUDA device "
        f"({why}); set cpu_fallback: true on the pipeline to run such stages on the CPU"
    )
