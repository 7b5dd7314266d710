"""Declarative pipeline config: models, loading, strict validation and topology queries.

A `PipelineConfig` is the contract between a model's pipeline definition and the runtime.
It is checked completely before anything starts; every problem is reported at once, each
naming its location (`stages[<name>].<field>` or `pipeline.<field>`). Request-time hooks
(`route_fn`, `wait_for_fn`, `stream_done_to_fn`, `terminal_stages_fn`) return subsets of
the static declaration and are checked by the runtime, not here.

Importable without torch.
"""

from omnirail.config.loading import format_topology, load_pipeline
from omnirail.config.models import (
    NAME_RE,
    ConfigError,
    EndpointsConfig,
    InputStreamConfig,
    MetricsConfig,
    PipelineConfig,
    RelayConfig,
    RestartConfig,
    StageConfig,
    StreamConfig,
)
from omnirail.config.validation import validate

__all__ = [
    "NAME_RE",
    "ConfigError",
    "EndpointsConfig",
    "InputStreamConfig",
    "MetricsConfig",
    "PipelineConfig",
    "RelayConfig",
    "RestartConfig",
    "StageConfig",
    "StreamConfig",
    "format_topology",
    "load_pipeline",
    "validate",
]
