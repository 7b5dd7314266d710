"""The Open Inference Protocol (KServe v2) gRPC front door, served by the coordinator.

`inference.GRPCInferenceService` on the coordinator's port, beside the native API: the
pipeline is one model (`api.model`, else its name; version "1") whose inputs and outputs
are the named tensors its `api:` section declares (omnirail.config.api). ModelInfer runs
one request and answers when it ends; ModelStreamInfer (Triton's decoupled streaming,
what tritonclient's `start_stream` speaks) sends a response per stream chunk as the
stages make it, then one with the result outputs. Requests go through `Coordinator.start`
like the native API's, so they are admitted, traced (metadata `traceparent`), counted,
deadlined and aborted the same way; the caller's `id` is echoed, never used as the mesh's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from importlib import metadata
from typing import TYPE_CHECKING, Any

import grpc

from omnirail.config.api import ApiConfig, OutputSpec
from omnirail.coordinator.calls import abort_call, principal_of
from omnirail.coordinator.kserve_tensors import (
    add_output,
    concat,
    request_inputs,
    requested_outputs,
    tensor_metadata,
    to_array,
)
from omnirail.coordinator.outbox import ClientOutbox
from omnirail.coordinator.requests import RequestRecord, State
from omnirail.coordinator.session import traceparent_of
from omnirail.kserve import grpc_predict_v2_pb2 as pb
from omnirail.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from omnirail.transport.malformed import is_malformed, malformed_message
from omnirail.v1 import client_pb2
from omnirail.wire.errors import Code, OmniError, internal, invalid
from omnirail.wire.payload import PayloadError, decode_inline, encode_inline

if TYPE_CHECKING:
    from omnirail.coordinator.service import Coordinator

log = logging.getLogger(__name__)

VERSION = "1"
KSERVE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
PLATFORM = "omnirail"
# Request parameters (Triton's names) that the front door reads.
TIMEOUT_PARAM = "timeout"  # int64 microseconds (tritonclient), or double seconds
EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"
FRONT_DOOR = "kserve"


class KServe(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.api: ApiConfig = coordinator.pipeline.api
        self.model = coordinator.pipeline.model_name

    # ---- health and metadata ---------------------------------------------------------

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="omnirail", version=_version(), extensions=[])

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        await self._check_model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=self._ready())

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        await self._check_model(request.name, request.version, context)
        return pb.ModelMetadataResponse(
            name=self.model,
            versions=[VERSION],
            platform=PLATFORM,
            inputs=[tensor_metadata(i) for i in self.api.inputs],
            outputs=[tensor_metadata(o) for o in self.api.outputs],
        )

    def _ready(self) -> bool:
        return not self.coordinator.registry.missing() and not self.coordinator.draining

    def _model_problem(self, name: str, version: str) -> OmniError | None:
        if name != self.model:
            shown = name[:64] + ("..." if len(name) > 64 else "")
            return OmniError(
                Code.NOT_FOUND, f"unknown model {shown!r}; this server serves {self.model!r}"
            )
        if version not in ("", VERSION):
            return OmniError(
                Code.NOT_FOUND, f"model {self.model!r} has no version {version[:16]!r}; it has '1'"
            )
        return None

    async def _check_model(
        self, name: str, version: str, context: grpc.aio.ServicerContext
    ) -> None:
        problem = self._model_problem(name, version)
        if problem is not None:
            await context.abort(problem.grpc_status, problem.message)

    # ---- inference ---------------------------------------------------------------------

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        try:
            call = self._start(
                request,
                context.time_remaining(),
                traceparent_of(context),
                principal_of(self.coordinator.security, context),
            )
        except OmniError as exc:
            await abort_call(context, exc)  # with the retry hint of a refusal
            raise  # unreachable: abort raises
        try:
            await call.rec.done.wait()
        except asyncio.CancelledError:
            self.coordinator.end(
                call.rec, State.ABORTED, OmniError(Code.CANCELLED, "client cancelled the call")
            )
            raise
        if isinstance(call.answer, OmniError):
            await abort_call(context, call.answer)
        assert call.answer is not None  # unary calls always have an answer
        return call.answer

    async def ModelStreamInfer(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        outbox: ClientOutbox[pb.ModelStreamInferResponse] = self.coordinator.client_outbox(
            "kserve_stream"
        )
        live: dict[str, _Call] = {}
        caller_traceparent = traceparent_of(context)
        principal = principal_of(self.coordinator.security, context)
        malformed: list[str] = []

        def failed(request: pb.ModelInferRequest, error: OmniError) -> None:
            response = pb.ModelInferResponse(
                model_name=self.model, model_version=VERSION, id=request.id
            )
            outbox.push(
                pb.ModelStreamInferResponse(error_message=error.message, infer_response=response)
            )

        def on_done(call: _Call) -> None:
            live.pop(call.rec.request_id, None)
            if isinstance(call.answer, OmniError):
                failed(call.request, call.answer)
            elif call.answer is not None:
                outbox.push(pb.ModelStreamInferResponse(infer_response=call.answer))
            outbox.wake.set()

        def stream_to(call: _Call, message: pb.ModelStreamInferResponse) -> None:
            # Twice the bound: the client reads nothing, even now that no request starts.
            self.coordinator.push_chunk(outbox, call.rec, message, slack=2)

        async def read() -> None:
            while True:
                # Full: no new work for a client that does not read (coordinator/outbox.py).
                await outbox.room.wait()
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    return
                if is_malformed(msg):
                    malformed.append(
                        malformed_message("/inference.GRPCInferenceService/ModelStreamInfer", msg)
                    )
                    return
                try:
                    call = self._start(
                        msg, None, caller_traceparent, principal, stream_to=stream_to
                    )
                except OmniError as exc:
                    failed(msg, exc)
                    continue
                live[call.rec.request_id] = call
                call.rec.on_done.append(lambda _, c=call: on_done(c))

        reader = asyncio.get_running_loop().create_task(read())
        try:
            # Until the client half-closes and every request it sent has answered.
            await outbox.pump(context.write, reader, lambda: bool(malformed) or not live)
            if malformed:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed[0])
        finally:
            reader.cancel()
            for call in list(live.values()):
                if not call.rec.finished:
                    self.coordinator.end(
                        call.rec, State.ABORTED, OmniError(Code.CANCELLED, "client stream closed")
                    )

    def _start(
        self,
        request: pb.ModelInferRequest,
        time_remaining: float | None,
        traceparent: str,
        principal: str,
        stream_to: Any = None,
    ) -> _Call:
        problem = self._model_problem(request.model_name, request.model_version)
        if problem is not None:
            raise problem
        coordinator = self.coordinator
        inputs = request_inputs(self.api, request, coordinator.pipeline.max_input_mb << 20)
        if not self.api.outputs:
            raise OmniError(
                Code.FAILED_PRECONDITION,
                f"model {self.model!r} declares no outputs (the pipeline's api.outputs)",
            )
        outputs = requested_outputs(self.api, request)
        try:
            payload = encode_inline(inputs)
        except PayloadError as exc:
            raise invalid(f"inputs: {exc}") from None
        generate = client_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            inputs=payload,
            timeout_s=_timeout(request),
        )
        rec = coordinator.start(generate, time_remaining, traceparent, principal)
        call = _Call(self, request, rec, outputs, stream_to)
        rec.on_chunk.append(call.on_chunk)
        # First in line: the request's outputs are gone once its on_done callbacks ran.
        rec.on_done.insert(0, call.on_done)
        return call


class _Call:
    """One inference request: collects chunk outputs, builds the responses."""

    def __init__(
        self,
        door: KServe,
        request: pb.ModelInferRequest,
        rec: RequestRecord,
        outputs: list[OutputSpec],
        stream_to: Any,
    ) -> None:
        self.door = door
        self.request = request
        self.rec = rec
        self.outputs = [o for o in outputs if o.stage in rec.terminals]
        self.stream_to = stream_to
        self.empty_final = _bool_param(request, EMPTY_FINAL)
        # Unary calls keep the chunk fields of chunk-only outputs to join them at the end.
        self.parts: dict[str, list[Any]] = {o.name: [] for o in self.outputs}
        self.error: OmniError | None = None
        # Set as the request ends: the final response (None: a stream has nothing left to
        # send) or the error to answer with.
        self.answer: pb.ModelInferResponse | OmniError | None = None

    def _response(self) -> pb.ModelInferResponse:
        return pb.ModelInferResponse(
            model_name=self.door.model, model_version=VERSION, id=self.request.id
        )

    def on_chunk(self, chunk: client_pb2.Chunk) -> None:
        specs = [o for o in self.outputs if o.stage == chunk.stage and o.chunks is not None]
        if not specs or self.error is not None:
            return
        try:
            data = decode_inline(chunk.data, numpy_only=True)
            if self.stream_to is None:
                for spec in specs:
                    if spec.result is None:
                        self.parts[spec.name].append(spec.of_chunk(data))
                return
            response = self._response()
            for spec in specs:
                add_output(response, spec, to_array(spec, spec.of_chunk(data)))
            if self.empty_final:
                response.parameters[FINAL].bool_param = False
            self.stream_to(self, pb.ModelStreamInferResponse(infer_response=response))
        except (OmniError, PayloadError) as exc:
            # The pipeline broke its declaration: the request fails, nothing else does.
            err = exc if isinstance(exc, OmniError) else internal(f"chunk payload: {exc}")
            self.error = err
            log.warning("kserve: request %s: %s", self.rec.request_id, err.message)
            self.door.coordinator.end(self.rec, State.FAILED, err)

    def on_done(self, rec: RequestRecord) -> None:
        try:
            self.answer = self._final(unary=self.stream_to is None)
        except OmniError as exc:
            self.answer = exc

    def _final(self, unary: bool) -> pb.ModelInferResponse | None:
        rec = self.rec
        if rec.state != State.COMPLETED:
            raise self.error or rec.error or internal("request ended without a result")
        result = rec.result()
        response = self._response()
        for spec in self.outputs:
            if spec.result is not None:
                if not unary and spec.chunks is not None:
                    continue  # already streamed, chunk by chunk
                payload = result.outputs.get(spec.stage)
                if payload is None:
                    continue
                try:
                    value = decode_inline(payload, numpy_only=True)
                except PayloadError as exc:
                    raise internal(f"result of stage {spec.stage!r}: {exc}") from None
                add_output(response, spec, to_array(spec, spec.of_result(value)))
            elif unary:
                add_output(response, spec, concat(spec, self.parts[spec.name]))
        if not unary:
            if not response.outputs and not self.empty_final:
                return None
            if self.empty_final:
                response.parameters[FINAL].bool_param = True
        return response


def _bool_param(request: pb.ModelInferRequest, name: str) -> bool:
    param = request.parameters.get(name)
    return (
        param is not None
        and param.WhichOneof("parameter_choice") == "bool_param"
        and (param.bool_param)
    )


def _timeout(request: pb.ModelInferRequest) -> float:
    """Seconds from the request's `timeout` parameter (Triton clients send microseconds as
    int64; a double is seconds); 0: the pipeline's default."""
    param = request.parameters.get(TIMEOUT_PARAM)
    if param is None:
        return 0.0
    kind = param.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        value = getattr(param, kind) / 1e6
    elif kind == "double_param":
        value = param.double_param
    else:
        raise invalid(f"parameters.timeout: a number, not a {kind}")
    if not 0 <= value <= 86400 * 7:
        raise invalid(f"parameters.timeout: {value}s is out of range")
    return value


def _version() -> str:
    try:
        return metadata.version("omnirail")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0"
