"""The Coordinator service: each stage replica's Attach stream, and its liveness."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from omnirail.coordinator.admission import register_error
from omnirail.coordinator.calls import abort_call
from omnirail.coordinator.events import StageEvents
from omnirail.coordinator.failover import watch_liveness
from omnirail.coordinator.registry import Replica
from omnirail.transport.grpc_server import write_until_read_ends
from omnirail.v1 import mesh_pb2, mesh_pb2_grpc

log = logging.getLogger(__name__)


class StageLink(StageEvents, mesh_pb2_grpc.CoordinatorServicer):
    """The stages' side: each replica's Attach stream (registration, its events, the
    commands the coordinator pushes) and the liveness watch over them."""

    async def Attach(
        self,
        request_iterator: AsyncIterator[mesh_pb2.StageEvent],
        context: grpc.aio.ServicerContext,
    ) -> None:
        first = await anext(aiter(request_iterator), None)
        problem = register_error(first, self.pipeline.stage_names)
        if problem is not None:
            await abort_call(context, problem)
        assert first is not None
        reg = first.register
        replica = Replica(
            reg.stage,
            reg.replica_id,
            reg.address,
            reg.pid,
            metrics_address=reg.metrics_address,
            relay_infos=tuple(reg.relay_infos),
        )
        # A replica may register draining (it joins to finish work, or to deliver only):
        # it is then never in the routed topology.
        replica.draining = first.draining
        old = self.registry.add(replica)
        if old is not None:
            old.push(mesh_pb2.CoordinatorCommand(shutdown=mesh_pb2.Shutdown(reason="replaced")))
        log.info("stage %s replica %s registered at %s", reg.stage, reg.replica_id, reg.address)
        # Its member token goes out with (in the same write as) its first topology, which
        # `_topology_changed` merges into this pending command.
        replica.push(mesh_pb2.CoordinatorCommand(member_token=replica.member_token))
        replica.task = asyncio.current_task()
        if self._liveness is None:
            self._liveness = asyncio.get_running_loop().create_task(
                watch_liveness(self.registry, self.pipeline.liveness_s, self._on_silent)
            )
        await self._topology_changed()
        if replica.draining:
            self._unreleased = self.registry.release_drained(self.requests.live.values())

        async def read() -> None:
            async for event in request_iterator:
                self._on_event(replica, event)

        try:
            await write_until_read_ends(context, read(), replica.wake, replica.take)
        finally:
            if self._lose(replica, "went away"):
                await self._topology_changed()

    def _on_silent(self, replica: Replica, silent_s: float) -> None:
        """A replica stopped answering: it is lost like a dead one, and its Attach call is
        cancelled (should it wake up, it attaches again as a fresh replica)."""
        why = (
            f"stopped answering (nothing heard for {silent_s:.1f}s; "
            f"liveness_s is {self.pipeline.liveness_s:g})"
        )
        if self._lose(replica, why):
            if replica.task is not None:
                replica.task.cancel()
            asyncio.get_running_loop().create_task(self._topology_changed())
