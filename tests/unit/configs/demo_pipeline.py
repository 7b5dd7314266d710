"""Python form of a pipeline config, loaded by tests/unit/config/."""

from omnirail.config import PipelineConfig, StageConfig

F = "tests.unit.config.helpers:factory"

pipeline = PipelineConfig(
    name="py-demo",
    stages=[
        StageConfig(name="a", factory=F, next="b"),
        StageConfig(name="b", factory="omnirail_cfg_local_helpers:make", terminal=True),
    ],
)
