"""What users and tests need to test pipelines: tiny checkpoints with random weights made
on the spot (`omnirail.testing.tiny`; nothing is downloaded), and `LocalMesh`, a
pipeline's coordinator and stage hosts in one process (`omnirail.testing.local_mesh`); and
synthetic speech that voice activity detection takes for speech (`omnirail.testing.speech`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirail.testing.local_mesh import LocalMesh

__all__ = ["LocalMesh"]


def __getattr__(name: str) -> Any:
    # Imported on use: the tiny builders need no gRPC server, and the CLI imports this package.
    if name == "LocalMesh":
        from omnirail.testing.local_mesh import LocalMesh

        return LocalMesh
    raise AttributeError(f"module 'omnirail.testing' has no attribute {name!r}")
