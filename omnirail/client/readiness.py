"""Whether a mesh is ready, in one place: `Client.wait_ready` and the launcher ask this.

The coordinator's answer (`PipelineInfo.ready`, which its grpc.health status for
`omnirail.v1.Omnirail` mirrors) is "every stage has a live replica". A caller that started
the mesh itself can also wait for every replica it started (`replicas`).
"""

from __future__ import annotations

from collections.abc import Mapping

from omnirail.v1 import client_pb2


def not_ready(info: client_pb2.PipelineInfo, replicas: Mapping[str, int] | None = None) -> str:
    """Why the mesh `info` describes is not ready yet ("" when it is)."""
    if replicas is not None:
        live = {s.name: sum(r.live for r in s.replicas) for s in info.stages}
        missing = [name for name, want in replicas.items() if live.get(name, 0) < want]
    else:
        missing = [s.name for s in info.stages if not any(r.live for r in s.replicas)]
    if missing:
        return f"waiting for stages: {', '.join(missing)}"
    if not info.ready:
        return "waiting for the coordinator to see every stage"
    return ""
