"""A receiver-pulled relay whose fetch is in-process: the shared pulled core
(relay/pull.py) under test without any transfer library."""

from __future__ import annotations

from typing import Any

from omnirail.relay.base import RelayError, RelaySettings
from omnirail.relay.host_pool import HostExtent
from omnirail.relay.pull import PullRelay
from omnirail.v1 import common_pb2


class FakePull(PullRelay):
    """Fetches straight from a sender relay of this process (its `source`)."""

    name = "fakepull"
    by_id: dict[str, FakePull] = {}

    def __init__(self, settings: RelaySettings | None = None) -> None:
        super().__init__(settings)
        FakePull.by_id[self.peer_id] = self

    def _add_peer(self, peer_id: str, info: dict[str, Any]) -> FakePull:
        sender = FakePull.by_id.get(peer_id)
        if sender is None:  # a malformed or foreign info: set_peers ignores it
            raise ValueError("not in this process")
        return sender

    async def _fetch(
        self, peer: Any, descriptor: common_pb2.RelayDescriptor, target: HostExtent
    ) -> None:
        tid, nbytes = descriptor.transfer_id, descriptor.nbytes
        src = peer.source(tid, descriptor.offset, nbytes)
        if src is None:
            raise RelayError(f"transfer {tid} is not live")
        try:
            target.view(nbytes)[:] = src
        finally:
            peer.end_send(tid)
