"""`omnirail bench pipeline --tls`: what TLS, mutual TLS and tokens cost, in one run.

Two meshes of the same linear pipeline are up at once: one plaintext, one with
`--tls auto` (TLS on every hop, mutual on the stages' servers, the mesh secret on Attach and
Deliver) and a bearer token on the client API. Rounds alternate between them (latency,
then throughput) so both see the same machine load; the report gives each figure's median
and the secured-over-plaintext ratios.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirail.bench import pipeline_file
from omnirail.bench.pipeline_bench import TRACING_ENV, interleaved_rounds, pipeline_yaml, ratios
from omnirail.config.security import ENV_TOKENS_FILE


def run_tls_bench(
    *,
    stages: int = 3,
    payload_bytes: int = 0,
    requests: int = 300,
    concurrency: int = 64,
    throughput_requests: int = 2048,
    stage_ms: float = 0.0,
    pin: bool = True,
    rounds: int = 3,
    tcp: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from omnirail.ops.launcher import Mesh

    transport = "tcp" if tcp else None
    with tempfile.TemporaryDirectory(prefix="omnirail-tls-bench-") as tmp:
        tokens = Path(tmp) / "tokens"
        tokens.write_text(secrets.token_urlsafe(24) + "\n")
        tokens.chmod(0o600)
        secured_env = {**TRACING_ENV["off"], ENV_TOKENS_FILE: str(tokens)}
        with (
            pipeline_file(pipeline_yaml(stages, payload_bytes, stage_ms)) as path,
            Mesh(
                path, progress=progress, env=TRACING_ENV["off"], pin=pin, transport=transport
            ) as plain,
            Mesh(
                path, progress=progress, env=secured_env, pin=pin, transport=transport, tls="auto"
            ) as secured,
        ):
            sides = interleaved_rounds(
                {"plaintext": plain, "tls": secured},
                rounds,
                requests,
                payload_bytes,
                throughput_requests,
                concurrency,
            )
    return {
        "stages": stages,
        "payload_bytes": payload_bytes,
        "requests": requests,
        "concurrency": concurrency,
        "throughput_requests": throughput_requests,
        "rounds": rounds,
        "transport": "tcp" if tcp else "unix",
        "secured_with": "--tls auto (TLS on every hop, mutual at stages, mesh secret) + a token",
        **sides,
        "tls_over_plaintext": ratios(sides["tls"], sides["plaintext"]),
        "pinned": pin,
    }
