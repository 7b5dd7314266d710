"""Python form of a pipeline config, loaded by tests/unit/test_config.py."""

from omnirail.config import PipelineConfig, StageConfig

F = "tests.unit.test_config:factory"

pipeline = PipelineConfig(
    name="py-demo",
    stages=[
        StageConfig(name="a", factory=F, next="b"),
        StageConfig(name="b", factory="omnirail_cfg_local_helpers:make", terminal=True),
    ],
)
