"""omnirail: multi-stage model pipelines as a gRPC service mesh.

The client SDK is importable without torch: ``from omnirail import Client``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "AbortResult",
    "AsyncClient",
    "Chunk",
    "Client",
    "GenerateResult",
    "InputError",
    "OmniError",
    "__version__",
]

if TYPE_CHECKING:
    from omnirail.client.sdk import AbortResult, AsyncClient, Chunk, Client, GenerateResult
    from omnirail.wire.errors import InputError, OmniError


def __getattr__(name: str) -> Any:
    # Lazy so `import omnirail.config` does not pull grpc into config-only users.
    if name in ("AbortResult", "AsyncClient", "Chunk", "Client", "GenerateResult"):
        from omnirail.client import sdk as client

        return getattr(client, name)
    if name in ("InputError", "OmniError"):
        from omnirail.wire import errors

        return getattr(errors, name)
    raise AttributeError(name)
