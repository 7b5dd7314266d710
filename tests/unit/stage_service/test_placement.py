"""Placement: a stage process sees the one GPU its config gives it, its factory is told the
device, and a GPU it cannot have fails start-up naming the stage and field."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirail.config import PipelineConfig
from omnirail.stage_service.host import factory_args
from omnirail.stage_service.placement import (
    GPUS_ENV,
    VISIBLE_ENV,
    Asked,
    Placement,
    PlacementError,
    asked_gpu,
    narrow,
    settle,
)
from tests.unit.config.helpers import pipe, st

NO_DRIVER = lambda: None  # noqa: E731


def cfg(**pipeline: Any) -> PipelineConfig:
    return PipelineConfig.from_dict(
        pipe(
            st("pre", next="enc"),
            st("enc", gpu=1, next="tp", process="shared"),
            st("tp", gpu=[2, 3], tp_size=2, next="post"),
            st("post", process="shared", terminal=True),
            **pipeline,
        )
    )


def test_the_process_gpu_comes_from_its_stages_and_a_tp_rank_takes_its_own() -> None:
    c = cfg()
    assert asked_gpu(c, ["pre"]) is None
    assert asked_gpu(c, ["enc", "post"]) == Asked("enc", 1)
    assert asked_gpu(c, ["tp"], tp_rank=0) == Asked("tp", 2)
    assert asked_gpu(c, ["tp"], tp_rank=1) == Asked("tp", 3)
    assert Asked("enc", 1).field == "stages[enc].gpu"


def test_narrow_leaves_one_device_visible() -> None:
    env: dict[str, str] = {}
    narrow(Asked("enc", 1), env, NO_DRIVER)
    assert env == {VISIBLE_ENV: "1"}
    # Ids count among what the launcher sees.
    env = {VISIBLE_ENV: "4, 5,6"}
    narrow(Asked("enc", 1), env, NO_DRIVER)
    assert env[VISIBLE_ENV] == "5"
    # A container given GPUs 2 and 3 sees them as its devices 0 and 1.
    env = {GPUS_ENV: "2,3"}
    narrow(Asked("tp", 3), env, NO_DRIVER)
    assert env[VISIBLE_ENV] == "1"
    env = {}
    narrow(None, env, NO_DRIVER)
    assert env == {}  # a CPU process is left alone


@pytest.mark.parametrize(
    ("env", "count", "message"),
    [
        ({VISIBLE_ENV: "0,1"}, None, "stages[x].gpu: GPU 2 is past the 2 visible GPU(s)"),
        ({VISIBLE_ENV: ""}, None, "stages[x].gpu: GPU 2 is past the 0 visible GPU(s)"),
        ({}, 2, "stages[x].gpu: GPU 2 is past the 2 GPU(s) of this host"),
        ({GPUS_ENV: "0,1"}, None, "stages[x].gpu: GPU 2 is not among the GPUs this container"),
    ],
)
def test_a_gpu_past_the_visible_ones_is_refused(
    env: dict[str, str], count: int | None, message: str
) -> None:
    before = dict(env)
    with pytest.raises(PlacementError) as info:
        narrow(Asked("x", 2), env, lambda: count)
    assert str(info.value).startswith(message), info.value
    assert env == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
def test_without_cuda_a_gpu_stage_fails_start_up_unless_cpu_fallback() -> None:
    with pytest.raises(PlacementError) as info:
        settle(cfg(), Asked("enc", 1), {VISIBLE_ENV: "1"})
    message = str(info.value)
    assert message.startswith("stages[enc].gpu: GPU 1 asked for, but this process sees no CUDA")
    assert "cpu_fallback: true" in message
    assert settle(cfg(cpu_fallback=True), Asked("enc", 1), {}) == Placement("cpu", 1, True)
    assert settle(cfg(), None, {}) == Placement()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_cuda_the_stage_runs_on_its_device() -> None:
    assert settle(cfg(), Asked("enc", 0), {}) == Placement("cuda:0", 0)


def placed_factory(device: str = "?", gpu_id: int | None = -1, size: int = 0) -> Any:
    return (device, gpu_id, size)


def plain_factory(size: int = 0) -> Any:
    return size


def test_factories_are_told_their_device_where_they_take_it() -> None:
    c = PipelineConfig.from_dict(
        pipe(
            st("a", factory=f"{__name__}:placed_factory", next="b", factory_args={"size": 3}),
            st("b", factory=f"{__name__}:placed_factory", factory_args={"device": "cpu"}, next="c"),
            st("c", factory=f"{__name__}:plain_factory", terminal=True),
        )
    )
    here = Placement("cuda:0", 1)
    assert factory_args(c, "a", placed_factory, here) == {
        "size": 3,
        "device": "cuda:0",
        "gpu_id": 1,
    }
    # What the config sets wins; a factory without the parameters gets neither.
    assert factory_args(c, "b", placed_factory, here) == {"device": "cpu", "gpu_id": 1}
    assert factory_args(c, "c", plain_factory, here) == {}
