"""A stage replica's Attach stream to the coordinator.

Registers, then sends completions, failures and abort acks, batched per write; receives
topology, aborts and shutdown. Reconnects (and re-registers) when the coordinator goes
away and comes back, so stages may start before the coordinator does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from omnirail.transport.batching import wait_until
from omnirail.transport.deliver import channel_options
from omnirail.transport.security import MeshSecurity, mesh_channel
from omnirail.v1 import common_pb2, mesh_pb2, mesh_pb2_grpc
from omnirail.wire.errors import OmniError

log = logging.getLogger(__name__)

LOAD_INTERVAL_S = 1.0
CommandHandler = Callable[[mesh_pb2.CoordinatorCommand], None]


class AttachClient:
    def __init__(
        self,
        coordinator: str,
        register: mesh_pb2.Register,
        on_command: CommandHandler,
        *,
        max_message_bytes: int = 64 << 20,
        load: Callable[[], tuple[int, int]] | None = None,
        security: MeshSecurity | None = None,
    ) -> None:
        self._address = coordinator
        self._security = security
        self._register = register
        self._on_command = on_command
        self._max_message_bytes = max_message_bytes
        self._load = load
        self._event = mesh_pb2.StageEvent()
        self._wake = asyncio.Event()
        self.connected = asyncio.Event()
        self._stopping = False
        self._load_due = False
        self._draining = False

    # ---- upward events (called on the loop thread) ----------------------------

    def complete(self, request_id: str, output: common_pb2.Payload, traceparent: str) -> None:
        self._event.completions.add(request_id=request_id, output=output, traceparent=traceparent)
        self._wake.set()

    def chunk(
        self, request_id: str, chunk_id: int, modality: str, data: common_pb2.Payload
    ) -> None:
        self._event.chunks.add(
            request_id=request_id, chunk_id=chunk_id, modality=modality, data=data
        )
        self._wake.set()

    def fail(self, request_id: str, error: OmniError) -> None:
        self._event.failures.add(request_id=request_id, error=error.to_proto())
        self._wake.set()

    def abort_ack(self, request_id: str) -> None:
        self._event.abort_acks.add(request_id=request_id)
        self._wake.set()

    def drain(self) -> None:
        """Tells the coordinator (now, and in every later event) that this replica takes
        no new work."""
        self._draining = True
        self._load_due = True
        self._wake.set()

    @property
    def idle(self) -> bool:
        """Nothing waits to go out (completions, failures, chunks, acks)."""
        return not _nonempty(self._event)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # ---- stream --------------------------------------------------------------

    async def run(self) -> None:
        """Keeps the stream up until `stop()` or a shutdown command."""
        delay = 0.05
        while not self._stopping:
            try:
                await self._attach_once()
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    # Not a member (no or a wrong mesh secret): say so each try, slowly.
                    log.error("coordinator %s refused this stage: %s", self._address, exc.details())
                    delay = 1.0
                elif self.connected.is_set():
                    log.warning("attach to %s lost: %s", self._address, exc.code().name)
            except Exception:
                log.exception("attach to %s failed", self._address)
            self.connected.clear()
            if self._stopping:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _attach_once(self) -> None:
        channel, metadata = mesh_channel(
            self._security, self._address, channel_options(self._max_message_bytes), aio=True
        )
        async with channel:
            stub = mesh_pb2_grpc.CoordinatorStub(channel)
            call = stub.Attach(wait_for_ready=True, metadata=metadata)
            # A draining replica that attaches again stays out of the routed topology.
            await call.write(mesh_pb2.StageEvent(register=self._register, draining=self._draining))
            first = await call.read()
            if first is grpc.aio.EOF:
                raise ConnectionError("coordinator closed the stream during registration")
            self._on_command(first)
            self.connected.set()
            log.info("stage %s attached to %s", self._register.stage, self._address)
            loop = asyncio.get_running_loop()
            reader = loop.create_task(self._read(call))
            ticker = loop.create_task(self._tick())
            try:
                await self._write(call, reader)
            finally:
                ticker.cancel()
                reader.cancel()
                call.cancel()

    async def _tick(self) -> None:
        """Asks for a load report once a second, riding with events when there are any."""
        if self._load is None:
            return
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            self._load_due = True
            self._wake.set()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while (command := await call.read()) is not grpc.aio.EOF:
            self._on_command(command)
            if command.HasField("shutdown"):
                self._stopping = True
                self._wake.set()
                return

    async def _write(self, call: grpc.aio.StreamStreamCall, reader: asyncio.Task[None]) -> None:
        reader.add_done_callback(lambda _: self._wake.set())
        while True:
            await wait_until(
                self._wake, lambda: self._has_events() or self._stopping or reader.done()
            )
            if self._has_events():
                # Flushed even when the reader ended: abort acks answering a shutdown, say.
                await call.write(self._swap())
            if reader.done():
                reader.result()
                return
            if self._stopping and not self._has_events():
                await call.done_writing()
                return

    def _has_events(self) -> bool:
        return self._load_due or _nonempty(self._event)

    def _swap(self) -> mesh_pb2.StageEvent:
        event, self._event = self._event, mesh_pb2.StageEvent()
        self._load_due = False
        event.draining = self._draining
        if self._load is not None:
            depth, inflight = self._load()
            event.load.queue_depth = depth
            event.load.inflight = inflight
        return event


def _nonempty(event: mesh_pb2.StageEvent) -> bool:
    return bool(event.completions or event.failures or event.abort_acks or event.chunks)
