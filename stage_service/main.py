"""Runs one stage process (one or more stages) until SIGINT/SIGTERM or shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from omnirail.config import PipelineConfig
from omnirail.stage.tp import TensorParallel
from omnirail.stage_service import placement
from omnirail.stage_service.placement import Placement

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# How long a stopping process lets a compute thread that is still busy go on.
STOP_COMPUTE_WAIT_S = 0.5


def configure_process(
    pipeline: PipelineConfig, stage_names: list[str], tp_rank: int | None = None
) -> Placement:
    """Environment, GPU placement and torch threads; must run before stage factories
    import models (and before anything initializes CUDA). Raises PlacementError when the
    process's `gpu:` cannot apply here."""
    for key, value in pipeline.env_defaults.items():
        os.environ.setdefault(key, value)
    for name in stage_names:
        for key, value in pipeline.stage(name).env.items():
            os.environ.setdefault(key, value)
    asked = placement.asked_gpu(pipeline, stage_names, tp_rank)
    placement.narrow(asked, os.environ)
    import torch

    placed = placement.settle(pipeline, asked, os.environ)
    # Oversubscribing cores collapses throughput; each stage states what it needs.
    threads = max(pipeline.stage(n).torch_threads for n in stage_names)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass
    return placed


async def serve(
    pipeline: PipelineConfig,
    stage_names: list[str],
    *,
    coordinator: str,
    listen: str,
    advertise: str | None = None,
    shm_prefix: str = "omnirail",
    metrics_host: str | None = None,
    metrics_port: int | None = None,
    tp_rank: int | None = None,
    tp_init: str | None = None,
    heartbeat: str | None = None,
) -> None:
    from omnirail.stage_service.host import StageHost
    from omnirail.telemetry import setup_tracing
    from omnirail.telemetry.metrics import StageMetrics
    from omnirail.telemetry.metrics_http import (
        dial_address,
        metrics_endpoint,
        start_metrics_server,
        stop_metrics_server,
    )
    from omnirail.transport.security import mesh_security

    placed = configure_process(pipeline, stage_names, tp_rank)
    log.info("stages %s run on %s", stage_names, placed.device)
    tp = None
    if tp_rank is not None:
        tp = await _join_tp(pipeline, stage_names, tp_rank, tp_init, placed)
        if tp_rank > 0:
            await asyncio.to_thread(_follow, pipeline, stage_names[0], placed, tp)
            return
    telemetry = setup_tracing(f"omnirail-stage-{'+'.join(stage_names)}")
    metrics = StageMetrics()
    metrics_address = ""
    security = mesh_security(pipeline)
    endpoint = metrics_endpoint(pipeline.metrics, stage=True, host=metrics_host, port=metrics_port)
    if endpoint is not None:
        tls = security.metrics_tls()
        metrics_address = start_metrics_server(metrics.registry, *endpoint, tls)
        scheme = "https" if tls else "http"
        log.info("stages %s metrics at %s://%s/metrics", stage_names, scheme, metrics_address)
    host = StageHost(
        pipeline,
        stage_names,
        coordinator=coordinator,
        listen=listen,
        advertise=advertise,
        shm_prefix=shm_prefix,
        tracer=telemetry.tracer,
        metrics=metrics,
        metrics_address=dial_address(metrics_address, endpoint[0], advertise) if endpoint else "",
        placement=placed,
        tp=tp,
        security=security,
    )
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()

    def on_signal() -> None:
        if signalled.is_set():  # a second one: stop now, drained or not
            host.shutdown_requested.set()
        signalled.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    address = await host.start()
    log.info("stages %s listening on %s", stage_names, address)
    beat = loop.create_task(_beat(heartbeat)) if heartbeat else None
    try:
        await _first(host.shutdown_requested.wait(), signalled.wait())
        if signalled.is_set():
            # SIGTERM (`omnirail down`, `omnirail restart`, a container stop): finish
            # what this process holds first; new work goes elsewhere meanwhile.
            if not await host.drain(pipeline.drain_s):
                log.warning(
                    "stages %s: still busy after drain_s %gs; stopping anyway",
                    stage_names,
                    pipeline.drain_s,
                )
    finally:
        if beat is not None:
            beat.cancel()
        # What a compute thread still runs now is for no request this process holds (the
        # drain waited for those, or ran out and they failed): its result would be dropped,
        # so the process does not wait out the scheduler's 5 s join for it.
        await host.stop(compute_wait_s=STOP_COMPUTE_WAIT_S)
        if tp is not None:
            tp.close()
        if metrics_address:
            stop_metrics_server(metrics_address, wait=False)  # the process exits next
        # Spans of requests that just ended must not be lost at shutdown.
        await asyncio.to_thread(telemetry.shutdown)


async def _first(*waits: Any) -> None:
    """Returns when the first of `waits` (coroutines) is done; cancels the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _beat(path: str) -> None:
    """Touches `path` every second from the event loop: a process stopped (SIGSTOP) or
    whose loop is wedged stops beating, and its supervisor can tell (omnirail/ops/
    supervise.py). The file is the supervisor's; a failure to write it is logged once."""
    warned = False
    while True:
        try:
            with open(path, "a"):
                os.utime(path)
        except OSError as exc:
            if not warned:
                log.warning("cannot write the heartbeat file %s: %s", path, exc)
                warned = True
        await asyncio.sleep(HEARTBEAT_S)


async def _join_tp(
    pipeline: PipelineConfig,
    stage_names: list[str],
    rank: int,
    init_method: str | None,
    placed: Placement,
) -> TensorParallel:
    """Joins the stage's tensor-parallel group (blocks until every rank is there)."""
    stage = pipeline.stage(stage_names[0])
    if len(stage_names) != 1 or stage.tp_size < 2:
        raise ValueError(
            f"--tp-rank is for a tensor-parallel stage alone in its process; "
            f"stages[{stage.name}].tp_size is {stage.tp_size}"
        )
    if not 0 <= rank < stage.tp_size:
        raise ValueError(
            f"--tp-rank {rank} is outside stages[{stage.name}].tp_size {stage.tp_size}"
        )
    if not init_method:
        raise ValueError("--tp-rank needs --tp-init tcp://HOST:PORT (rank 0's rendezvous)")
    return await asyncio.to_thread(
        TensorParallel.join, stage.name, rank, stage.tp_size, init_method, placed.device
    )


def _follow(pipeline: PipelineConfig, name: str, placed: Placement, tp: TensorParallel) -> None:
    """A follower rank: builds the stage's model as rank 0 does, then runs the calls rank
    0 broadcasts until it stops; a broken group ends the process with an error."""
    from omnirail.stage_service.host import build_scheduler

    build_scheduler(pipeline, name, placed, tp)  # registers its shared calls
    try:
        tp.follow()
    finally:
        tp.close()
