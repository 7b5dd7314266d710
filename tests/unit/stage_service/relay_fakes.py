"""A scripted relay: `put_nowait` succeeds only while `free` (and not on `full_edges`),
`put` waits until a test sets `gate`, and every handle records its release."""

from __future__ import annotations

import asyncio
from typing import Any

from omnirail.relay.base import Relay, RelayHandle
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed


class Handle(RelayHandle):
    def __init__(self, relay: ScriptedRelay, request_id: str, nbytes: int, how: str) -> None:
        self.relay = relay
        self.request_id = request_id
        self.how = how  # "nowait", "put" or "forward"
        relay.ids += 1
        self.descriptor = common_pb2.RelayDescriptor(
            backend=relay.name, nbytes=nbytes, transfer_id=relay.ids
        )
        self.released = False
        relay.live.append(self)

    def release(self) -> None:
        self.released = True
        if self in self.relay.live:
            self.relay.live.remove(self)


class ScriptedRelay(Relay):
    name = "scripted"

    def __init__(self) -> None:
        self.free = True  # put_nowait succeeds (on edges not in `full_edges`)
        self.full_edges: set[str] = set()
        self.gate = asyncio.Event()  # put returns once set
        self.fail: Exception | None = None  # put raises it once the gate opens
        self.forwardable: set[int] = set()  # ids of Packed that forward_nowait hands on
        self.live: list[Handle] = []
        self.waiting_puts = 0
        self.cancelled_puts = 0
        self.ids = 0

    def put_nowait(self, packed: Packed, request_id: str, edge: str) -> Handle | None:
        if not self.free or edge in self.full_edges:
            return None
        return Handle(self, request_id, packed.nbytes, "nowait")

    def forward_nowait(self, packed: Packed, request_id: str, edge: str) -> Handle | None:
        if id(packed) in self.forwardable:
            return Handle(self, request_id, packed.nbytes, "forward")
        return None

    async def put(self, packed: Packed, request_id: str, edge: str) -> Handle:
        self.waiting_puts += 1
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled_puts += 1
            raise
        finally:
            self.waiting_puts -= 1
        if self.fail is not None:
            raise self.fail
        return Handle(self, request_id, packed.nbytes, "put")

    async def get(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None = None
    ) -> Any:
        raise NotImplementedError

    def cleanup(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass
