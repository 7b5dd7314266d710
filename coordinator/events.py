"""Stage events: what a replica reports, applied to the request table."""

from __future__ import annotations

import asyncio
import logging
import time

from omnirail.coordinator.lifecycle import RequestLifecycle
from omnirail.coordinator.registry import Replica
from omnirail.coordinator.requests import Overloaded, State
from omnirail.v1 import client_pb2, mesh_pb2
from omnirail.wire.errors import Code, OmniError

log = logging.getLogger(__name__)


class StageEvents(RequestLifecycle):
    """What the stages report on their Attach streams, applied to the requests: chunks
    for the client, terminal results, failures, abort acknowledgements, load, draining."""

    def _on_event(self, replica: Replica, event: mesh_pb2.StageEvent) -> None:
        replica.last_heard = time.monotonic()
        for chunk in event.chunks:
            self._on_chunk(replica, chunk)
        for done in event.completions:
            self._on_completion(replica, done)
        for failure in event.failures:
            self._on_failure(failure)
        for ack in event.abort_acks:
            self._on_abort_ack(replica, ack.request_id)
        if event.HasField("load"):
            replica.queue_depth = event.load.queue_depth
            replica.inflight = event.load.inflight
        if event.draining and not replica.draining:
            self._on_draining(replica)

    def _on_chunk(self, replica: Replica, chunk: mesh_pb2.ClientChunk) -> None:
        """A terminal stage's stream chunk, for the client of a streaming call."""
        rec = self.requests.by_wire(chunk.request_id)
        if rec is None or not rec.on_chunk or replica.stage not in rec.terminals:
            return
        rec.chunks += 1
        if rec.chunks == 1:
            self.metrics.first_chunk(time.monotonic() - rec.started)
            if rec.span is not None:
                rec.span.event("first_chunk", {"omnirail.stage": replica.stage})
        out = client_pb2.Chunk(
            stage=replica.stage, chunk_id=chunk.chunk_id, modality=chunk.modality, data=chunk.data
        )
        for on_chunk in rec.on_chunk:
            on_chunk(out)

    def _on_completion(self, replica: Replica, done: mesh_pb2.Completion) -> None:
        """A terminal stage's result; the request completes with its last terminal's."""
        rec = self.requests.by_wire(done.request_id)
        if rec is None or replica.stage not in rec.terminals:
            return
        rec.outputs[replica.stage] = done.output
        if len(rec.outputs) == len(rec.terminals):
            self.end(rec, State.COMPLETED, None)

    def _on_failure(self, failure: mesh_pb2.Failure) -> None:
        rec = self.requests.by_wire(failure.request_id)
        if rec is None:
            return
        err = OmniError.from_proto(failure.error)
        if err.code == Code.UNAVAILABLE:  # a stage could not reach the next (it is gone)
            self._lost(rec, err)
        elif err.code == Code.RESOURCE_EXHAUSTED:  # a stage's queue is full
            self._fail(rec, Overloaded(err.message, err.stage))
        else:
            self._fail(rec, err)

    def _on_abort_ack(self, replica: Replica, wire_id: str) -> None:
        wait = self._abort_waits.get(wire_id)
        if wait is None:
            return
        owed, acked, done_event = wait
        owed.discard((replica.stage, replica.replica_id))
        acked.append(f"{replica.stage}/{replica.replica_id}")
        if not owed:
            done_event.set()

    def _on_draining(self, replica: Replica) -> None:
        """It finishes what it holds; new work goes to the others from now on."""
        replica.draining = True
        log.info("stage %s replica %s is draining", replica.stage, replica.replica_id)
        asyncio.get_running_loop().create_task(self._topology_changed())
        self._unreleased = self.registry.release_drained(self.requests.live.values())
