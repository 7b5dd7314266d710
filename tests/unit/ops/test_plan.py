"""omnirail.ops.plan: the stage processes both the launcher and compose start."""

from __future__ import annotations

from omnirail.config import PipelineConfig
from omnirail.ops.compose_groups import plan_services
from omnirail.ops.plan import StageProcess, plan_processes


def _cfg() -> PipelineConfig:
    fn = "tests.integration.stagefns:double"
    return PipelineConfig.from_dict(
        {
            "name": "p",
            "stages": [
                {"name": "a", "factory": fn, "next": "b", "process": "front"},
                {"name": "b", "factory": fn, "next": "c", "process": "front"},
                {
                    "name": "c",
                    "factory": fn,
                    "next": "d",
                    **{"replicas": 2, "gpu": [1, 0], "tp_size": 2},
                },
                {"name": "d", "factory": fn, "terminal": True},
            ],
        },
        resolve=False,
    )


def test_one_process_per_group_replica_and_tp_rank_in_declaration_order() -> None:
    assert plan_processes(_cfg()) == [
        StageProcess("front", ("a", "b")),
        StageProcess("c", ("c",), 0, (1,), 0, 2),
        StageProcess("c", ("c",), 0, (0,), 1, 2),
        StageProcess("c", ("c",), 1, (1,), 0, 2),
        StageProcess("c", ("c",), 1, (0,), 1, 2),
        StageProcess("d", ("d",)),
    ]
    assert [p.name for p in plan_processes(_cfg())] == [
        "front",
        "c-0_tp0",
        "c-0_tp1",
        "c-1_tp0",
        "c-1_tp1",
        "d",
    ]


def test_compose_services_are_the_planned_processes() -> None:
    cfg = PipelineConfig.from_dict(
        {
            "name": "p",
            "stages": [
                {"name": "a", "factory": "x:y", "next": "c", "process": "front"},
                {"name": "c", "factory": "x:y", "next": "d", "replicas": 2, "gpu": 0},
                {"name": "d", "factory": "x:y", "terminal": True},
            ],
        },
        resolve=False,
    )
    services = plan_services(cfg)
    assert [(s.group, s.stages, s.replica) for s in services] == [
        (p.group, p.stages, p.replica) for p in plan_processes(cfg)
    ]


def test_compose_services_restart_as_their_stage_says() -> None:
    cfg = PipelineConfig.from_dict(
        {
            "name": "p",
            "stages": [
                {"name": "a", "factory": "x:y", "next": "b", "restart": {"max": 2}},
                {"name": "b", "factory": "x:y", "terminal": True, "restart": {"max": 0}},
            ],
        },
        resolve=False,
    )
    assert [s.restart for s in plan_services(cfg)] == ["on-failure:2", "no"]
