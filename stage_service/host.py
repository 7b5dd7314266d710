"""A stage process: hosts one or more stages behind one gRPC server.

Owns what is per process: the relays (one pool per backend), the Deliver server, the
outgoing Deliver channels (one per receiver address), and the topology the coordinator
pushes. Each hosted stage has its own Attach stream and its own scheduler.

Items for a stage hosted here are dispatched in the process (`deliver`): no gRPC, no
relay, values by reference; each stage keeps its own scheduler, spans and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import grpc

from omnirail.config import PipelineConfig, dotted
from omnirail.relay.base import Relay
from omnirail.stage.scheduler import STOP_WAIT_S, Scheduler, SimpleScheduler
from omnirail.stage.tp import TensorParallel
from omnirail.stage_service.attach import AttachClient
from omnirail.stage_service.edge_sender import LocalValue, Releasable
from omnirail.stage_service.edges import EdgeRelays
from omnirail.stage_service.placement import Placement
from omnirail.stage_service.relays import open_relays, plan_relays, relay_host
from omnirail.stage_service.stage import Stage
from omnirail.telemetry.metrics import StageMetrics, watch_relay
from omnirail.telemetry.tracer import Tracer
from omnirail.transport.deliver import DeliverChannel
from omnirail.transport.grpc_server import SERVING, bind, create_server, write_until_read_ends
from omnirail.transport.security import MeshSecurity, mesh_security
from omnirail.v1 import mesh_pb2, mesh_pb2_grpc
from omnirail.wire.errors import OmniError, invalid, unavailable
from omnirail.wire.routing import replica_for

log = logging.getLogger(__name__)

# How long a draining process must be idle before it counts as drained.
DRAIN_SETTLE_S = 0.3
# Streams whose replica this process remembers (the oldest are forgotten first).
MAX_STICKY_STREAMS = 8192


def factory_args(
    pipeline: PipelineConfig,
    name: str,
    factory: Any,
    placement: Placement,
    tp: TensorParallel | None = None,
) -> dict[str, Any]:
    """The stage's factory arguments, with its placement added where the factory takes
    it and the config does not set it: `device` ("cuda:0" or "cpu"), `gpu_id` (the
    config's GPU id, None on the CPU) and `tp` (its tensor-parallel rank and group)."""
    args = pipeline.factory_args_for(name)
    injected = (
        ("device", placement.device),
        ("gpu_id", placement.gpu),
        ("tp", tp or TensorParallel(name, device=placement.device)),
    )
    for key, value in injected:
        if key not in args and dotted.accepts(factory, key):
            args[key] = value
    return args


def build_scheduler(
    pipeline: PipelineConfig,
    name: str,
    placement: Placement | None = None,
    tp: TensorParallel | None = None,
) -> Scheduler:
    """Calls the stage factory; a plain callable becomes a `SimpleScheduler` (on a
    tensor-parallel stage, a call every rank runs: `TensorParallel.shared`)."""
    cfg = pipeline.stage(name)
    factory = dotted.resolve(cfg.factory, pipeline.source_dir)
    made = factory(**factory_args(pipeline, name, factory, placement or Placement(), tp))
    if callable(made) and not isinstance(made, Scheduler):
        if tp is not None and tp.size > 1:
            made = tp.shared("fn", made)
        made = SimpleScheduler(made, name=name)
    if isinstance(made, Scheduler):
        sources = pipeline.stream_sources_of(name)
        if sources and not made.takes_streams:
            raise TypeError(
                f"stages[{name}]: {', '.join(sources)} stream to it, but its scheduler "
                f"{type(made).__name__} takes no stream input; use StreamingScheduler or "
                "ARScheduler"
            )
        return made
    raise TypeError(
        f"stages[{name}].factory {cfg.factory!r} returned {type(made).__name__}; "
        "expected a Scheduler or a callable"
    )


class StageHost(mesh_pb2_grpc.StageServicer):
    def __init__(
        self,
        pipeline: PipelineConfig,
        stage_names: list[str],
        *,
        coordinator: str,
        listen: str,
        advertise: str | None = None,
        shm_prefix: str = "omnirail",
        replica_id: str | None = None,
        tracer: Tracer | None = None,
        metrics: StageMetrics | None = None,
        metrics_address: str = "",
        placement: Placement | None = None,
        tp: TensorParallel | None = None,
        security: MeshSecurity | None = None,
    ) -> None:
        self.pipeline = pipeline
        # TLS and membership for this host's server and every channel it opens.
        self.security = security or mesh_security(pipeline)
        self.placement = placement or Placement()
        # Rank 0 of a tensor-parallel stage's group (None for other stages).
        self.tp = tp
        self._tracer = tracer
        # One registry for every stage hosted here; the address goes out in Register.
        self._metrics = metrics or StageMetrics()
        self._metrics_address = metrics_address
        self.stage_names = stage_names
        self._coordinator = coordinator
        self._listen = listen
        self._advertise = advertise
        self._shm_prefix = shm_prefix
        self.replica_id = replica_id or f"{'+'.join(stage_names)}-{uuid.uuid4().hex[:8]}"
        self._max_message = pipeline.endpoints.max_message_mb << 20
        self.stages: dict[str, Stage] = {}
        self._attach: dict[str, AttachClient] = {}
        self._relays: dict[str, Relay] = {}
        self._channels: dict[str, DeliverChannel] = {}
        # The replica at each address in the last topology (channels open only after one).
        self._replica_at: dict[str, str] = {}
        self._topology: dict[str, list[str]] = {}
        self._address_stage: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # Local deliveries in flight (kept so they are not collected before they run).
        self._local_tasks: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None
        self.shutdown_requested = asyncio.Event()
        # Stages here the coordinator released while they drain (nothing needs them).
        self._released: set[str] = set()
        # (request, target stage) -> the replica address its stream goes to (`_route`).
        self._streams_to: OrderedDict[tuple[str, str], str] = OrderedDict()

    # ---- lifecycle -----------------------------------------------------------

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        if self.tp is not None:
            self.tp.on_broken = lambda: loop.call_soon_threadsafe(self._tp_broke)
        schedulers = {
            name: build_scheduler(self.pipeline, name, self.placement, self.tp)
            for name in self.stage_names
        }
        server, health = create_server(
            [mesh_pb2.DESCRIPTOR.services_by_name["Stage"].full_name],
            max_message_bytes=self._max_message,
            security=self.security,
        )
        mesh_pb2_grpc.add_StageServicer_to_server(self, server)
        address = bind(server, self._listen, self.security.server_credentials(internal=True))
        self._server = server
        advertise = self._advertise or address
        # Before serving: a backend that cannot start fails start-up, naming its edges.
        self._relays.update(
            await open_relays(
                plan_relays(self.pipeline, self.stage_names),
                self._shm_prefix,
                relay_host(advertise),
            )
        )
        for backend, relay in self._relays.items():
            watch_relay(self._metrics, backend, relay.held)
        relay_infos = [info for relay in self._relays.values() if (info := relay.local_info())]
        await server.start()
        for name in self.stage_names:
            attach = AttachClient(
                self._coordinator,
                mesh_pb2.Register(
                    stage=name,
                    replica_id=self.replica_id,
                    address=advertise,
                    pid=os.getpid(),
                    relay_backends=sorted(self._relays),
                    metrics_address=self._metrics_address,
                    relay_infos=relay_infos,
                ),
                lambda cmd, n=name: self._on_command(n, cmd),
                max_message_bytes=self._max_message,
                load=lambda n=name: (self.stages[n].scheduler.queue_depth, self.stages[n].inflight),
                security=self.security,
            )
            stage = Stage(
                name,
                self.pipeline,
                schedulers[name],
                EdgeRelays.of(self.pipeline, name, self._relays, local=self.stage_names),
                self._relays,
                self,
                attach,
                self._tracer,
                self._metrics,
                device=self.placement.device,
            )
            stage.start()
            self.stages[name] = stage
            self._attach[name] = attach
            self._tasks.append(asyncio.get_running_loop().create_task(self._run_attach(attach)))
        await health.set("", SERVING)
        return advertise

    def _tp_broke(self) -> None:
        """A rank of this stage's group is gone: the call that found it failed with
        UNAVAILABLE; stop (a moment later, so that failure reaches the coordinator) and
        let the launcher restart the group. Requests still here fail as the stage goes."""
        asyncio.get_running_loop().call_later(0.2, self.shutdown_requested.set)

    async def _run_attach(self, attach: AttachClient) -> None:
        await attach.run()
        # The stream only ends for good on shutdown (or stop()).
        self.shutdown_requested.set()

    async def wait_attached(self, timeout: float) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(a.connected.wait() for a in self._attach.values())), timeout
        )

    async def drain(self, grace_s: float) -> bool:
        """Stops taking new work (the coordinator routes none here from its next
        topology) and lets what this process holds finish, for up to `grace_s`. Done when
        the coordinator has released it (no live request may still need it: with every
        replica of a stage draining, as when a compose project stops, requests running
        elsewhere still pass it) and it has been idle, no request in a stage, nothing
        queued, sent or unreported, for `DRAIN_SETTLE_S` (items routed here before the
        topology changed are still on their way), or at once when no coordinator is
        attached: a request cannot end without one, so nothing more is worth waiting for
        (as when a whole mesh stops, its coordinator first). True when that came in time."""
        for attach in self._attach.values():
            attach.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        quiet_since: float | None = None
        while (now := loop.time()) < deadline and not self.shutdown_requested.is_set():
            if self._busy() or self._needed():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= (DRAIN_SETTLE_S if self._attached() else 0.0):
                return True
            await asyncio.sleep(0.02)
        return not self._busy()

    def _attached(self) -> bool:
        return any(a.connected.is_set() for a in self._attach.values())

    def _needed(self) -> bool:
        """The coordinator may still send work here: a stage of this process is not
        released yet (see `Coordinator._release_drained`) and its Attach stream is up
        (a coordinator that is gone sends nothing)."""
        return any(
            a.connected.is_set() and name not in self._released for name, a in self._attach.items()
        )

    def _busy(self) -> bool:
        return (
            any(s.inflight or s.scheduler.queue_depth for s in self.stages.values())
            or any(c.inflight for c in self._channels.values())
            or bool(self._local_tasks)
            or not all(a.idle for a in self._attach.values())
        )

    async def stop(self, compute_wait_s: float = STOP_WAIT_S) -> None:
        """Stops everything this process runs (`compute_wait_s`: see `Stage.stop`)."""
        for attach in self._attach.values():
            attach.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.tp is not None:
            self.tp.on_broken = None  # stopping anyway: a follower gone first is no news
            await asyncio.to_thread(self.tp.stop_followers)
        for stage in self.stages.values():
            await stage.stop(compute_wait_s)
        for channel in self._channels.values():
            await channel.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        for relay in self._relays.values():
            relay.close()

    # ---- Router (used by stages) ---------------------------------------------

    def deliver(
        self,
        item: mesh_pb2.DeliverItem,
        handle: Releasable | None,
        local: LocalValue | None = None,
    ) -> None:
        stage = self.stages.get(item.to_stage)
        if stage is not None:
            self._deliver_here(stage, item, handle, local)
            return
        endpoints = self._topology.get(item.to_stage)
        if not endpoints:
            if handle is not None:
                handle.release()
            self._report_lost(
                [item.request_id], f"no live replica of stage {item.to_stage!r}", item.to_stage
            )
            return
        address = self._route(item, endpoints)
        channel = self._channels.get(address)
        if channel is None:
            channel = DeliverChannel(
                address,
                self.replica_id,
                lambda rids, why, a=address: self._report_lost(
                    rids, why, self._address_stage.get(a, "")
                ),
                max_message_bytes=self._max_message,
                security=self.security,
            )
            self._channels[address] = channel
        channel.send(item, handle)

    def _route(self, item: mesh_pb2.DeliverItem, endpoints: list[str]) -> str:
        """The replica of `item.to_stage` for this item: `replica_for` its request id, what
        every producer computes (a fan-in's producers agree without asking). A stream
        stays where its first chunk went while that replica is in the topology: when a
        replica joins, n changes, and a stream moved mid-way would reach a replica that
        never saw its start."""
        if not item.HasField("stream"):
            return replica_for(item.request_id, endpoints)
        key = (item.request_id, item.to_stage)
        address = self._streams_to.get(key)
        if address is None or address not in endpoints:
            address = replica_for(item.request_id, endpoints)
        signal = item.stream
        if signal.done or signal.HasField("error"):  # the stream's last item
            self._streams_to.pop(key, None)
            return address
        self._streams_to[key] = address
        self._streams_to.move_to_end(key)
        if len(self._streams_to) > MAX_STICKY_STREAMS:
            self._streams_to.popitem(last=False)
        return address

    def _deliver_here(
        self,
        stage: Stage,
        item: mesh_pb2.DeliverItem,
        handle: Releasable | None,
        local: LocalValue | None,
    ) -> None:
        """Hands `item` to a stage of this process. A task per item, started in order: a
        local item never waits inside `on_item` (nothing to read), so each runs to its end
        in turn and order per (request, edge) holds; and the sender's own call (often
        inside its outbox callback) is never re-entered by the receiver's work."""

        def ack(error: OmniError | None) -> None:
            # An error was already reported by the receiver (it fails the request); the
            # ack only returns the sender's stream credit.
            if handle is not None:
                handle.release()

        task = asyncio.get_running_loop().create_task(stage.on_item(item, ack, local))
        self._local_tasks.add(task)
        task.add_done_callback(self._local_tasks.discard)

    def possible_stages(self, terminals: tuple[str, ...]) -> frozenset[str]:
        return self.pipeline.possible_stages(terminals)

    def _report_lost(self, request_ids: list[str], why: str, stage: str) -> None:
        reporter = next(iter(self._attach.values()))
        for rid in request_ids:
            reporter.fail(rid, unavailable(why, stage))

    # ---- coordinator commands ------------------------------------------------

    def _on_command(self, stage_name: str, cmd: mesh_pb2.CoordinatorCommand) -> None:
        if cmd.HasField("topology"):
            self._topology = {
                name: [e.address for e in eps.endpoints]
                for name, eps in cmd.topology.stages.items()
            }
            self._address_stage = {a: name for name, addrs in self._topology.items() for a in addrs}
            stages = cmd.topology.stages.values()
            self._retire_channels(
                {e.address: e.replica_id for eps in stages for e in eps.endpoints}
            )
            infos = list(
                dict.fromkeys(
                    info
                    for eps in cmd.topology.stages.values()
                    for ep in eps.endpoints
                    for info in ep.relay_infos
                )
            )
            for relay in self._relays.values():
                relay.set_peers(infos)
        for abort in cmd.aborts:
            for target in self._topology:
                self._streams_to.pop((abort.request_id, target), None)
            self.stages[stage_name].abort(abort.request_id, abort.reason)
            for relay in self._relays.values():
                relay.cleanup(abort.request_id)
            for channel in self._channels.values():
                channel.forget_request(abort.request_id)
            self._attach[stage_name].abort_ack(abort.request_id)
        if cmd.released:
            self._released.add(stage_name)
        if cmd.HasField("shutdown"):
            log.info("stage %s: shutdown requested (%s)", stage_name, cmd.shutdown.reason)
            self.shutdown_requested.set()

    def _retire_channels(self, replicas: dict[str, str]) -> None:
        """Closes channels whose address lost its replica or got a new one (a restart at
        the same address): what they still hold went to the old process, and a stream
        opened while the address was down must not carry the new replica's traffic."""
        for address in list(self._channels):
            if self._replica_at.get(address) == replicas.get(address):
                continue
            channel = self._channels.pop(address)
            gone = f"replica at {address} was replaced or went away"
            task = asyncio.get_running_loop().create_task(channel.close(gone))
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)
        self._replica_at = replicas

    # ---- Deliver server --------------------------------------------------------

    async def Deliver(
        self,
        request_iterator: AsyncIterator[mesh_pb2.DeliverBatch],
        context: grpc.aio.ServicerContext,
    ) -> None:
        acks = mesh_pb2.AckBatch()
        wake = asyncio.Event()

        def ack_for(seq: int):
            def ack(error: OmniError | None) -> None:
                a = acks.acks.add(seq=seq)
                if error is not None:
                    a.error.CopyFrom(error.to_proto())
                wake.set()

            return ack

        async def read() -> None:
            async for batch in request_iterator:
                for item in batch.items:
                    stage = self.stages.get(item.to_stage)
                    if stage is None:
                        err = invalid(
                            f"this process hosts {self.stage_names}, not {item.to_stage!r}"
                        )
                        ack_for(item.seq)(err)
                        if item.request_id:
                            next(iter(self._attach.values())).fail(item.request_id, err)
                        continue
                    await stage.on_item(item, ack_for(item.seq))

        def take() -> mesh_pb2.AckBatch | None:
            nonlocal acks
            if not acks.acks:
                return None
            batch, acks = acks, mesh_pb2.AckBatch()
            return batch

        await write_until_read_ends(context, read(), wake, take)
