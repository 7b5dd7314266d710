"""Sender side of a result: one part per target stage, each made by the target's
`project_payload` hook (or the whole output), packed once per edge.

What needs no waiting (inline, or a relay put with free credit) leaves at once, in
target order; a part that must wait for relay credit goes on in a task of its edge's
sender, and the caller hears once every such part has left. A result is the last thing
its request sends on an edge, so order per (request, edge) holds meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omnirail.stage_service.edge_sender import EdgeSender, EdgeSenders, Outgoing, SentToken
from omnirail.v1 import mesh_pb2


class ResultSender:
    """The result edges out of one stage."""

    def __init__(self, senders: EdgeSenders, project: Mapping[str, Callable[[Any], Any]]) -> None:
        self._senders = senders
        self._project = project

    def send(
        self,
        request_id: str,
        output: Any,
        targets: list[str],
        meta: mesh_pb2.RequestMeta,
        traceparent: str,
        ctx: Any,
        on_sent_later: Callable[[], None],
    ) -> bool:
        """Sends `output` to `targets`; True when every part left now, else False and
        `on_sent_later()` comes once the waiting parts have left. Raises what a
        projection or packing raised (before anything waits)."""
        # One target: nothing reads the payload after it is sent (the request ends once it
        # is), so received bytes may be forwarded rather than copied.
        forward = len(targets) == 1
        parts: list[tuple[EdgeSender, Outgoing]] = []
        for target in targets:
            project = self._project.get(target)
            sender = self._senders[target]
            packed = sender.prepare(project(output) if project is not None else output)
            parts.append(
                (sender, Outgoing(request_id, packed, None, meta, traceparent, None, ctx, forward))
            )
        later = [(sender, out) for sender, out in parts if not sender.send_now(out)]
        if not later:
            return True
        token = SentToken(request_id, len(later), lambda _: on_sent_later())
        for sender, out in later:
            out.token = token
            sender.put_later(out)
        return False
