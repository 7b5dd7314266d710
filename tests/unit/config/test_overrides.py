"""`--set PATH=VALUE` on a pipeline's data: stage fields by stage name, pipeline fields by
path, values read as YAML; a path that names nothing is refused in one line naming it."""

from __future__ import annotations

import pytest

from omnirail.config.overrides import SetError, apply_sets

DATA = {
    "name": "p",
    "relay": {"pool_mb": 8},
    "stages": [{"name": "thinker", "factory": "m:f", "next": "talker"}, {"name": "talker"}],
}


def test_stage_and_pipeline_fields_are_set_and_the_input_is_left_alone() -> None:
    out = apply_sets(
        DATA,
        [
            "stages.thinker.gpu=0",
            "stages.talker.replicas=2",
            "stages.talker.cpus=[2, 3]",
            "max_live_requests=64",
            "relay.pool_mb=512",
            "metrics.enabled=false",
            "name='0'",
        ],
    )
    assert out["stages"][0]["gpu"] == 0 and out["stages"][1]["replicas"] == 2
    assert out["stages"][1]["cpus"] == [2, 3]
    assert out["max_live_requests"] == 64 and out["relay"] == {"pool_mb": 512}
    assert out["metrics"] == {"enabled": False} and out["name"] == "0"
    assert "gpu" not in DATA["stages"][0] and DATA["relay"] == {"pool_mb": 8}


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        ("stages.vocoder.gpu=0", "no stage 'vocoder'; the stages are ['thinker', 'talker']"),
        ("stages.thinker.gpux=0", "stage 'thinker' has no field 'gpux'"),
        ("max_live=5", "the pipeline has no field 'max_live'"),
        ("stages.thinker=0", "name a field of the stage, e.g. stages.thinker.gpu"),
        ("gpu", "expected PATH=VALUE"),
        ("=3", "expected PATH=VALUE"),
        ("stages..gpu=1", "expected PATH=VALUE"),
        ("name.x=1", "name is not a mapping"),
        ("max_live_requests=[1", "--set max_live_requests:1:3: YAML syntax error"),
    ],
)
def test_a_set_that_names_nothing_is_one_line_naming_it(item: str, problem: str) -> None:
    with pytest.raises(SetError) as err:
        apply_sets(DATA, [item])
    message = str(err.value)
    assert "\n" not in message and problem in message, message
