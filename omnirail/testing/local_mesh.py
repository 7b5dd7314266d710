"""`LocalMesh`: a pipeline's coordinator and stage hosts in this process, on one event loop.

The same servers as `omnirail up` (the coordinator with its KServe service, one
`StageHost` per planned stage process and replica) speaking the same gRPC API over unix
sockets, but no subprocesses: a pipeline starts in the time its factories take, a stage
that fails to build raises here with its own traceback, and a test can look at (and act
on) the coordinator's request table and each host's stages directly.

    with LocalMesh("pipeline.yaml") as mesh:          # a loop in a background thread
        with mesh.client() as client:
            print(client.generate({"text": "hi"}).outputs)

    async with LocalMesh("pipeline.yaml") as mesh:    # on the caller's running loop
        async with mesh.async_client() as client:
            ...

What a process gives a stage and one process cannot give several, LocalMesh does not
apply: a stage's `env`, `gpu` and `cpus`, `torch_threads`, and tensor parallelism (a
`tp_size` > 1 stage is refused). Stages see the CPU as their device. Kills, signals,
supervision, drain on SIGTERM and relays between processes need `omnirail.ops.launcher.Mesh`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from omnirail.client.sdk import AsyncClient, Client
from omnirail.config import PipelineConfig, load_pipeline
from omnirail.coordinator.kserve import KServe
from omnirail.coordinator.service import Coordinator
from omnirail.kserve import grpc_predict_v2_pb2_grpc as kserve_grpc
from omnirail.ops.launcher import client_options
from omnirail.ops.plan import StageProcess, plan_processes
from omnirail.stage_service.host import StageHost
from omnirail.telemetry.metrics import CoordinatorMetrics, StageMetrics
from omnirail.telemetry.tracer import Tracer
from omnirail.transport.grpc_server import NOT_SERVING, SERVING, bind, create_server
from omnirail.transport.security import MeshSecurity, mesh_security
from omnirail.v1 import client_pb2_grpc, mesh_pb2, mesh_pb2_grpc
from omnirail.wire.errors import Code, OmniError
from omnirail.wire.services import PIPELINE_SERVICE

T = TypeVar("T")

# A stopping host lets a compute thread still busy go on this long (as a stage process).
STOP_COMPUTE_WAIT_S = 0.5
# How long a stopping mesh waits for an idle host to be released by the coordinator.
HOST_DRAIN_S = 2.0


class LocalMesh:
    """A pipeline served from this process. Use as a (sync or async) context manager, or
    call `start()`/`stop()` (or `await astart()`/`await astop()`)."""

    def __init__(
        self,
        pipeline: str | os.PathLike[str] | PipelineConfig,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        tracer: Tracer | None = None,
        timeout: float = 120.0,
    ) -> None:
        """`pipeline`: a pipeline file or a loaded `PipelineConfig`. `run_dir`: where the
        unix sockets go (default: a temporary folder, removed on stop). `tracer`: spans of
        every server here (default: none). `timeout`: how long `start` waits for every
        replica to attach."""
        self.pipeline = (
            pipeline if isinstance(pipeline, PipelineConfig) else load_pipeline(pipeline)
        )
        for stage in self.pipeline.stages:
            if stage.tp_size > 1:
                raise ValueError(
                    f"stages[{stage.name}].tp_size is {stage.tp_size}: LocalMesh runs no "
                    "tensor-parallel stage (its ranks are processes); use "
                    "omnirail.ops.launcher.Mesh"
                )
        self._own_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.tracer = tracer or Tracer()
        self.timeout = timeout
        self.security: MeshSecurity = mesh_security(self.pipeline)
        self.shm_prefix = f"omnirail-local-{uuid.uuid4().hex[:8]}"
        self.address: str | None = None
        self.coordinator: Coordinator | None = None
        self.metrics = CoordinatorMetrics()
        # Planned process name ("stage-<group>[-<replica>]") -> its host, while it runs.
        self.hosts: dict[str, StageHost] = {}
        self._planned = {f"stage-{p.name}": p for p in plan_processes(self.pipeline)}
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- async API (on the caller's loop) ------------------------------------------

    async def astart(self) -> str:
        """Starts the coordinator, then every stage host; returns once every replica has
        attached. A stage that cannot start raises (and nothing is left running)."""
        try:
            return await self._start()
        except BaseException:
            await self.astop()
            raise

    async def _start(self) -> str:
        if self.run_dir is None:
            # Short: a unix socket's path has at most 107 bytes.
            self.run_dir = Path(tempfile.mkdtemp(prefix="omnirail-local-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.get_running_loop()
        server, health = create_server(
            [PIPELINE_SERVICE, mesh_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name],
            max_message_bytes=self.pipeline.endpoints.max_message_mb << 20,
            security=self.security,
        )
        coordinator = Coordinator(self.pipeline, health, self.tracer, self.metrics, self.security)
        client_pb2_grpc.add_OmnirailServicer_to_server(coordinator, server)
        mesh_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        kserve_grpc.add_GRPCInferenceServiceServicer_to_server(KServe(coordinator), server)
        self.address = bind(
            server, self._socket("coordinator"), self.security.server_credentials(internal=False)
        )
        self._server = server
        self.coordinator = coordinator
        await server.start()
        await health.set("", SERVING)
        await health.set(PIPELINE_SERVICE, NOT_SERVING)
        for name in self._planned:
            await self.start_process(name, wait=False)
        await self.wait_ready()
        return self.address

    async def astop(self, drain_s: float = 0.0) -> None:
        """Stops the coordinator (after letting live requests run for `drain_s`), then
        every stage host; removes a run folder it made."""
        # As `omnirail down`: new requests are refused while live ones run on; then the
        # hosts drain (the coordinator releases them: a planned exit, no replica lost).
        coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            await coordinator.drain(drain_s)
            attached = [h for h in self.hosts.values() if h.stages]
            await asyncio.gather(*(h.drain(HOST_DRAIN_S) for h in attached))
        for name in list(self.hosts):
            await self.stop_process(name)
        if coordinator is not None:
            await coordinator.close()
        if self._server is not None:
            await self._server.stop(grace=0.2)
            self._server = None
        if self._own_run_dir and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    async def __aenter__(self) -> LocalMesh:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    async def start_process(self, name: str, *, wait: bool = True) -> StageHost:
        """Starts planned stage process `name` (`processes()`), e.g. again after
        `stop_process`: a fresh replica, as the launcher's restart gives."""
        if name not in self._planned:
            raise KeyError(f"no stage process {name!r}; this mesh plans {sorted(self._planned)}")
        if name in self.hosts:
            raise ValueError(f"stage process {name!r} is already running")
        assert self.address is not None and self.run_dir is not None
        planned = self._planned[name]
        host = StageHost(
            self.pipeline,
            list(planned.stages),
            coordinator=self.address,
            listen=self._socket(f"{name}-{uuid.uuid4().hex[:4]}"),
            shm_prefix=self.shm_prefix,
            tracer=self.tracer,
            metrics=StageMetrics(),
            security=self.security,
        )
        self.hosts[name] = host
        try:
            await host.start()
        except BaseException:
            del self.hosts[name]
            await host.stop(compute_wait_s=STOP_COMPUTE_WAIT_S)
            raise
        if wait:
            await host.wait_attached(self.timeout)
        return host

    async def stop_process(self, name: str) -> None:
        """Stops stage process `name` at once, drained or not: its Attach streams end, and
        the coordinator loses its replicas as it would a process that died."""
        host = self.hosts.pop(name, None)
        if host is None:
            raise KeyError(f"stage process {name!r} is not running")
        await host.stop(compute_wait_s=STOP_COMPUTE_WAIT_S)

    async def wait_ready(self) -> None:
        """Until every running host's replicas are in the coordinator's registry."""
        assert self.coordinator is not None
        registry = self.coordinator.registry
        deadline = time.monotonic() + self.timeout
        while True:
            want = {h.replica_id for h in self.hosts.values()}
            have = {r.replica_id for r in registry.all()}
            if want <= have and not registry.missing():
                return
            if time.monotonic() > deadline:
                raise OmniError(
                    Code.UNAVAILABLE,
                    f"LocalMesh: stages {registry.missing() or sorted(want - have)} did not "
                    f"attach in {self.timeout:g}s",
                )
            await asyncio.sleep(0.01)

    def processes(self) -> dict[str, StageProcess]:
        """The planned stage processes, by name (as `omnirail status` names them)."""
        return dict(self._planned)

    def async_client(self, **kwargs: Any) -> AsyncClient:
        """An `AsyncClient` of this mesh (TLS and a token when the pipeline is secured)."""
        return AsyncClient(self.address or "", **client_options(self.security), **kwargs)

    def _socket(self, name: str) -> str:
        assert self.run_dir is not None
        return f"unix://{self.run_dir / (name + '.sock')}"

    # ---- sync API (a loop in a background thread) ------------------------------------

    def start(self) -> str:
        """Starts the mesh on an event loop of its own, in a background thread."""
        if self._thread is not None:
            raise RuntimeError("this LocalMesh is already running")
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=loop.run_forever, name="omnirail-local-mesh", daemon=True
        )
        self._thread.start()
        self._loop = loop
        try:
            return self.run(self.astart())
        except BaseException:
            self._end_thread()
            raise

    def stop(self, drain_s: float = 0.0) -> None:
        if self._thread is None:
            return
        try:
            self.run(self.astop(drain_s))
        finally:
            self._end_thread()

    def _end_thread(self) -> None:
        loop, thread = self._loop, self._thread
        self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not thread.is_alive():
            loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coro` on the mesh's loop (the background thread's) and returns its
        result: how a sync test acts on the coordinator or a host."""
        if self._thread is None or self._loop is None:
            coro.close()
            raise RuntimeError("LocalMesh.run is for a mesh started with start() or `with`")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def client(self, **kwargs: Any) -> Client:
        """A blocking `Client` of this mesh."""
        return Client(self.address or "", **client_options(self.security), **kwargs)

    def __enter__(self) -> LocalMesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
