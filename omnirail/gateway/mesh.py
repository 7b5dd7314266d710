"""What the gateway's routes share: the mesh client, the request mapping, how mesh
events (stream chunks, the final result) become text and audio for HTTP answers, and,
where the pipeline declares the Realtime API, the server VAD's model and thread."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnirail.client.sdk import AsyncClient, Chunk, GenerateResult
from omnirail.config import PipelineConfig
from omnirail.gateway.audio import pcm16
from omnirail.gateway.metrics import GatewayMetrics
from omnirail.gateway.realtime.vad import SileroModel
from omnirail.gateway.requests import Plan, RequestMapper
from omnirail.telemetry.tracer import Tracer

log = logging.getLogger(__name__)

Event = Chunk | GenerateResult


class Gateway:
    """What the routes share: the mesh client, the mapping, tracing and metrics."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        connect: Callable[[], AsyncClient],
        tracer: Tracer | None = None,
        metrics: GatewayMetrics | None = None,
        forward_principals: bool = False,
    ) -> None:
        self.pipeline = pipeline
        # Requests name their HTTP caller's principal to the coordinator (the client shows
        # the mesh secret); False: they are the gateway's own token's.
        self.forward_principals = forward_principals
        self.model = pipeline.model_name
        self.api = pipeline.api
        self.mapper = RequestMapper(pipeline.api, self.model)
        oa = pipeline.api.openai
        assert oa is not None  # RequestMapper checked
        self.oa = oa
        self.text_spec = self.api.output(oa.text_output) if oa.text_output else None
        self.audio_spec = self.api.output(oa.audio_output) if oa.audio_output else None
        self._connect = connect
        self.client: AsyncClient | None = None
        self.tracer = tracer or Tracer()
        self.metrics = metrics or GatewayMetrics()
        self.created = int(time.time())
        self.realtime = oa.realtime
        # Sessions' VAD runs here, off the event loop: one thread is plenty (0.13 ms of CPU
        # per 32 ms of audio per session), and VAD steps of one session stay in order.
        self.vad_executor = (
            ThreadPoolExecutor(1, thread_name_prefix="omnirail-vad") if self.realtime else None
        )

    async def start(self) -> None:
        # grpc.aio channels belong to the loop that made them: made on uvicorn's.
        self.client = self._connect()
        if self.vad_executor is not None:
            await self._load_vad(self.vad_executor)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.vad_executor is not None:
            self.vad_executor.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    async def _load_vad(executor: ThreadPoolExecutor) -> None:
        """Loads the server VAD's model before the first session needs it (off the loop).
        Where it cannot load, the gateway still serves: sessions then say so
        (`vad_unavailable`) and take manual commits."""
        loop = asyncio.get_running_loop()
        try:
            model = await loop.run_in_executor(executor, SileroModel.shared)
        except (RuntimeError, ImportError, OSError) as exc:
            log.warning("realtime: server VAD unavailable (%s): sessions commit by hand", exc)
            return
        log.info("realtime: server VAD loaded (%s backend)", model.backend)

    # ---- mesh events -> text and audio pieces -------------------------------------------

    def text_of_chunk(self, chunk: Chunk) -> str | None:
        spec = self.text_spec
        if spec is None or spec.chunks is None or chunk.stage != spec.stage:
            return None
        return _text(spec.of_chunk(chunk.data))

    def audio_of_chunk(self, chunk: Chunk) -> tuple[bytes, int] | None:
        spec = self.audio_spec
        if spec is None or spec.chunks is None or chunk.stage != spec.stage:
            return None
        return pcm16(spec.of_chunk(chunk.data)), self.rate_of(chunk.data)

    def rate_of(self, data: Any) -> int:
        """The sample rate of an audio chunk or result: its `sample_rate` field, else the
        api's."""
        rate = data.get("sample_rate") if isinstance(data, dict) else None
        return int(rate) if isinstance(rate, int) and rate > 0 else self.oa.sample_rate

    def text_of_result(self, result: GenerateResult) -> str | None:
        spec = self.text_spec
        if spec is None or spec.result is None or spec.stage not in result.outputs:
            return None
        return _text(spec.of_result(result.outputs[spec.stage]))

    def audio_of_result(self, result: GenerateResult) -> tuple[bytes, int] | None:
        spec = self.audio_spec
        if spec is None or spec.result is None or spec.stage not in result.outputs:
            return None
        value = result.outputs[spec.stage]
        return pcm16(spec.of_result(value)), self.rate_of(value)

    # ---- one request ------------------------------------------------------------------

    def events(
        self, plan: Plan, rid: str, traceparent: str | None, principal: str | None = None
    ) -> AsyncGenerator[Event]:
        """The request's chunks, then its result. Closing it (or cancelling a read) aborts
        the request through the mesh, so every consumer closes it when done. `principal`:
        the HTTP caller's, which the request is attributed to."""
        assert self.client is not None
        return self.client.stream(
            plan.inputs,
            request_id=rid,
            traceparent=traceparent,
            on_behalf_of=self.on_behalf_of(principal),
        )

    def on_behalf_of(self, principal: str | None) -> str | None:
        """What a request names as its principal: the caller's, where the gateway forwards."""
        return principal if self.forward_principals and principal else None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else json.dumps(value)
