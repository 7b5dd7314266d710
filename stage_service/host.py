"""A stage process: hosts one or more stages behind one gRPC server.

Owns what is per process: the relays (one pool per backend), the Deliver server, the
router its stages send through (stage_service/router.py: the outgoing Deliver channels
and the topology the coordinator pushes), and the lifecycle. Each hosted stage has its
own Attach stream, scheduler, spans and metrics.

Deliver streams are authenticated per member (omnirail/transport/members.py): each hosted
stage's registration gets a member token from the coordinator; the process's outgoing
streams show one of them, and its Deliver server accepts a stream only from a sender the
topology lists with that token's digest, reading only relay descriptors that name what
that sender announced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from omnirail.config import PipelineConfig, dotted
from omnirail.relay.base import Relay, shown
from omnirail.relay.options import DEFAULT_PEER_WAIT_S
from omnirail.stage.scheduler import STOP_WAIT_S, Scheduler, SimpleScheduler
from omnirail.stage.tp import TensorParallel
from omnirail.stage_service.attach import AttachClient
from omnirail.stage_service.edges import EdgeRelays
from omnirail.stage_service.placement import Placement
from omnirail.stage_service.relays import open_relays, plan_relays, relay_host
from omnirail.stage_service.router import ProcessRouter
from omnirail.stage_service.stage import Stage
from omnirail.telemetry.metrics import StageMetrics, watch_relay
from omnirail.telemetry.tracer import Tracer
from omnirail.transport.grpc_server import SERVING, bind, create_server, write_until_read_ends
from omnirail.transport.members import MemberCredentials, MemberError, MemberTable
from omnirail.transport.security import MeshSecurity, mesh_security
from omnirail.v1 import mesh_pb2, mesh_pb2_grpc
from omnirail.wire.errors import OmniError, invalid, unavailable

log = logging.getLogger(__name__)

# How long a draining process must be idle before it counts as drained.
DRAIN_SETTLE_S = 0.3


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
        # Member tokens the coordinator gave each hosted stage's registration (secrets:
        # never logged), and the members of the last topology, whom Deliver authenticates.
        self._tokens: dict[str, bytes] = {}
        self.members = MemberTable()
        # How long a Deliver stream from a sender the topology does not list (yet) waits
        # for a topology that does (the coordinator tells the sender first).
        self.member_wait_s = DEFAULT_PEER_WAIT_S
        # Where this process's stages send (stages here by reference, others by channel).
        self.router = ProcessRouter(
            pipeline,
            self.stages,
            self.replica_id,
            self._report_lost,
            max_message_bytes=self._max_message,
            security=self.security,
            credentials=self.credentials,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._server: grpc.aio.Server | None = None
        self.shutdown_requested = asyncio.Event()
        # Stages here the coordinator released while they drain (nothing needs them).
        self._released: set[str] = set()

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
                self.router,
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
            or self.router.busy
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
        await self.router.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        for relay in self._relays.values():
            relay.close()

    def _report_lost(self, request_ids: list[str], why: str, stage: str) -> None:
        reporter = next(iter(self._attach.values()))
        for rid in request_ids:
            reporter.fail(rid, unavailable(why, stage))

    # ---- coordinator commands ------------------------------------------------

    def credentials(self) -> MemberCredentials | None:
        """What this process's Deliver streams show: the member token of its first hosted
        stage that has one (None before any registration got its token)."""
        for name in self.stage_names:
            token = self._tokens.get(name)
            if token:
                return MemberCredentials(self.replica_id, name, token)
        return None

    def _on_command(self, stage_name: str, cmd: mesh_pb2.CoordinatorCommand) -> None:
        if cmd.member_token:
            # Before the topology of the same command: channels it opens show this token.
            self._tokens[stage_name] = cmd.member_token
        if cmd.HasField("topology"):
            self.members.update(cmd.topology)
            self.router.set_topology(cmd.topology, self._relays)
        for abort in cmd.aborts:
            self.router.forget(abort.request_id)
            self.stages[stage_name].abort(abort.request_id, abort.reason)
            for relay in self._relays.values():
                relay.cleanup(abort.request_id)
            self._attach[stage_name].abort_ack(abort.request_id)
        for conversation in cmd.closed_conversations:
            self.stages[stage_name].scheduler.close_conversation(conversation)
        if cmd.released:
            self._released.add(stage_name)
        if cmd.HasField("shutdown"):
            log.info("stage %s: shutdown requested (%s)", stage_name, cmd.shutdown.reason)
            self.shutdown_requested.set()

    # ---- Deliver server --------------------------------------------------------

    async def Deliver(
        self,
        request_iterator: AsyncIterator[mesh_pb2.DeliverBatch],
        context: grpc.aio.ServicerContext,
    ) -> None:
        try:
            sender = await self.members.authenticate(
                context.invocation_metadata(), self.member_wait_s
            )
        except MemberError as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            return
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
                try:
                    sender.check()  # a topology may have dropped the member since
                except MemberError as e:
                    # Ends the call with this status once the reader returns.
                    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
                    context.set_details(str(e))
                    return
                for item in batch.items:
                    if not sender.sends_as(item.from_stage):
                        who = sender.member.describe()
                        err = invalid(
                            f"item's from_stage {shown(item.from_stage)} is not a stage of its "
                            f"sender, {who}"
                        )
                        # Only the sender hears of it: failing the request would let any
                        # member fail others' requests by naming them.
                        ack_for(item.seq)(err)
                        continue
                    stage = self.stages.get(item.to_stage)
                    if stage is None:
                        err = invalid(
                            f"this process hosts {self.stage_names}, not {item.to_stage!r}"
                        )
                        ack_for(item.seq)(err)
                        if item.request_id:
                            next(iter(self._attach.values())).fail(item.request_id, err)
                        continue
                    await stage.on_item(item, ack_for(item.seq), owners=sender.owners)

        def take() -> mesh_pb2.AckBatch | None:
            nonlocal acks
            if not acks.acks:
                return None
            batch, acks = acks, mesh_pb2.AckBatch()
            return batch

        await write_until_read_ends(context, read(), wake, take)
