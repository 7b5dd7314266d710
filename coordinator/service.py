"""The coordinator: the client API over the request lifecycle and the stages' Attach streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from omnirail.coordinator.admission import REQUEST_ID
from omnirail.coordinator.calls import RETRY_AFTER_KEY, abort_call, principal_of
from omnirail.coordinator.registry import describe
from omnirail.coordinator.requests import Ended, RequestRecord, State
from omnirail.coordinator.session import serve_session, stream_chunks, traceparent_of
from omnirail.coordinator.stage_link import StageLink
from omnirail.v1 import client_pb2, client_pb2_grpc
from omnirail.wire.errors import Code, OmniError, internal, invalid

__all__ = ["RETRY_AFTER_KEY", "Coordinator"]


class Coordinator(StageLink, client_pb2_grpc.OmnirailServicer):
    """The coordinator: the client API (`omnirail.v1.Omnirail`) over the request lifecycle
    (coordinator/lifecycle.py), with the stages' Attach streams (coordinator/stage_link.py)
    and their events (coordinator/events.py)."""

    # ---- client API ------------------------------------------------------------

    async def Generate(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        rec = await self._start_or_abort(request, context)
        results: list[client_pb2.Result] = []  # taken as it ends (then its outputs go)
        rec.on_done.append(
            lambda r: results.append(r.result()) if r.state == State.COMPLETED else None
        )
        try:
            if request.stream:
                await stream_chunks(self, rec, context)
            else:
                await rec.done.wait()
        except asyncio.CancelledError:
            # The client went away: nothing downstream should keep working on it.
            self.end(rec, State.ABORTED, OmniError(Code.CANCELLED, "client cancelled the call"))
            raise
        if results:
            await context.write(client_pb2.GenerateEvent(result=results[0]))
            return
        await abort_call(context, rec.error or internal("request ended without a result"))

    async def Session(
        self,
        request_iterator: AsyncIterator[client_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await serve_session(self, request_iterator, context)

    async def Submit(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.SubmitResponse:
        rec = await self._start_or_abort(request, context)
        rec.keep_result = True  # for Wait and GetRequest
        return client_pb2.SubmitResponse(request_id=rec.request_id)

    async def Wait(
        self, request: client_pb2.RequestRef, context: grpc.aio.ServicerContext
    ) -> client_pb2.RequestStatus:
        rec = await self._lookup(request.request_id, context)
        await rec.done.wait()
        # What the table kept as it ended (a live record's outputs go with its end).
        return (self.requests.get(request.request_id) or rec).status()

    async def GetRequest(
        self, request: client_pb2.RequestRef, context: grpc.aio.ServicerContext
    ) -> client_pb2.RequestStatus:
        return (await self._lookup(request.request_id, context)).status()

    async def Abort(
        self, request: client_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.AbortResponse:
        reason = request.reason or "aborted by client"
        if self.requests.get(request.request_id) is None and REQUEST_ID.fullmatch(
            request.request_id
        ):
            # Perhaps it overtook its request's start: that start is cancelled if it comes.
            self._early_aborts.add(request.request_id, reason)
            await abort_call(
                context,
                OmniError(
                    Code.NOT_FOUND,
                    f"unknown request_id {request.request_id!r} (if it starts within 30 s, "
                    "it is cancelled)",
                ),
            )
        rec = await self._lookup(request.request_id, context)
        response = client_pb2.AbortResponse(request_id=rec.request_id)
        if rec.finished:
            return response
        acked, missing = await self.abort(rec, OmniError(Code.CANCELLED, reason), wait=True)
        response.acknowledged_by.extend(acked)
        response.not_acknowledged.extend(missing)
        return response

    async def CloseConversation(
        self, request: client_pb2.ConversationRef, context: grpc.aio.ServicerContext
    ) -> client_pb2.CloseConversationResponse:
        try:
            self.close_conversation(request.conversation_id)
        except OmniError as exc:
            await abort_call(context, exc)
        return client_pb2.CloseConversationResponse()

    async def DescribePipeline(
        self, request: client_pb2.DescribePipelineRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.PipelineInfo:
        return describe(self.pipeline, self.registry, self.metrics_address)

    async def _lookup(
        self, request_id: str, context: grpc.aio.ServicerContext
    ) -> RequestRecord | Ended:
        rec = self.requests.get(request_id)
        if rec is None:
            await abort_call(
                context, OmniError(Code.NOT_FOUND, f"unknown request_id {request_id!r}")
            )
        assert rec is not None
        return rec

    async def _start_or_abort(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> RequestRecord:
        try:
            if request.input_stream:
                raise invalid("input_stream: input chunks are sent on a Session, not this call")
            principal = principal_of(self.security, context, request.on_behalf_of)
            return self.start(request, context.time_remaining(), traceparent_of(context), principal)
        except OmniError as exc:
            await abort_call(context, exc)
            raise  # unreachable: abort raises
