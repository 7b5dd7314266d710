"""Runs the coordinator service until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from omnirail.config import PipelineConfig
from omnirail.coordinator.kserve import KServe
from omnirail.coordinator.service import Coordinator
from omnirail.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from omnirail.telemetry import setup_tracing
from omnirail.telemetry.metrics import CoordinatorMetrics
from omnirail.telemetry.metrics_http import (
    metrics_endpoint,
    start_metrics_server,
    stop_metrics_server,
)
from omnirail.transport.grpc_server import NOT_SERVING, SERVING, bind, create_server
from omnirail.transport.security import mesh_security
from omnirail.v1 import client_pb2_grpc, mesh_pb2, mesh_pb2_grpc
from omnirail.wire.services import PIPELINE_SERVICE

log = logging.getLogger(__name__)


async def serve(
    pipeline: PipelineConfig,
    listen: str,
    ready_file: str | None = None,
    *,
    metrics_host: str | None = None,
    metrics_port: int | None = None,
) -> None:
    security = mesh_security(pipeline)
    for warning in security.warnings(listen):
        log.warning("security: %s", warning)
    server, health = create_server(
        # Not the KServe service: its descriptors live outside the default pool (see
        # scripts/gen_protos.sh), which is all reflection can serve; clients of the Open
        # Inference Protocol bring its proto.
        [PIPELINE_SERVICE, mesh_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name],
        max_message_bytes=pipeline.endpoints.max_message_mb << 20,
        security=security,
    )
    telemetry = setup_tracing("omnirail-coordinator")
    metrics = CoordinatorMetrics()
    coordinator = Coordinator(pipeline, health, telemetry.tracer, metrics, security)
    endpoint = metrics_endpoint(pipeline.metrics, stage=False, host=metrics_host, port=metrics_port)
    if endpoint is not None:
        # Before the ready file: DescribePipeline reports it from the first call on.
        tls = security.metrics_tls()
        coordinator.metrics_address = start_metrics_server(metrics.registry, *endpoint, tls)
        scheme = "https" if tls else "http"
        log.info("coordinator metrics at %s://%s/metrics", scheme, coordinator.metrics_address)
    client_pb2_grpc.add_OmnirailServicer_to_server(coordinator, server)
    mesh_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    # The Open Inference Protocol beside the native API, on the same port.
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServe(coordinator), server)
    address = bind(server, listen, security.server_credentials(internal=False))
    await server.start()
    await health.set("", SERVING)
    await health.set(PIPELINE_SERVICE, NOT_SERVING)
    log.info("coordinator for %r listening on %s", pipeline.name, address)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health.enter_graceful_shutdown()
    # Drain: what runs may end (the stages still serve: the launcher stops them after
    # the coordinator); new requests are refused meanwhile.
    left = await coordinator.drain(pipeline.drain_s)
    if left:
        log.warning("coordinator: %d request(s) still running after drain_s; failed them", left)
    await coordinator.close()
    # Nothing is live after the drain; what the grace lets end is a last write to a
    # client. The stages' Attach streams never end on their own, so a long grace would
    # only be waited out.
    await server.stop(grace=0.2)
    if coordinator.metrics_address:
        stop_metrics_server(coordinator.metrics_address, wait=False)  # the process exits next
    await asyncio.to_thread(telemetry.shutdown)
