"""A pulled relay's transfer handles: the sender's (`PulledHandle`: a pool extent and
the edge credit it holds until the receiver reports it done) and the receiver's
(`PulledReceived`: a view of its receive extent, freed on release)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnirail.relay.base import Received, RelayHandle
from omnirail.relay.credits import EdgeCredit
from omnirail.relay.host_pool import HostExtent, HostPool
from omnirail.v1 import common_pb2

if TYPE_CHECKING:
    from omnirail.relay.pull import PullRelay

EMPTY_VIEW = memoryview(b"")


class PulledHandle(RelayHandle):
    __slots__ = (
        "_credit",
        "_relay",
        "descriptor",
        "extent",
        "nbytes",
        "peer",
        "released",
        "request_id",
        "tid",
    )
    acked_in_band = False

    def __init__(
        self,
        relay: PullRelay,
        descriptor: common_pb2.RelayDescriptor,
        request_id: str,
        credit: EdgeCredit | None,
        extent: HostExtent | None,
        nbytes: int,
        tid: int,
    ) -> None:
        self._relay = relay
        self.descriptor = descriptor
        self.request_id = request_id
        self._credit = credit
        self.extent = extent
        self.nbytes = nbytes
        self.tid = tid
        # The peer it is bound to: the first one served it (None: nobody yet).
        self.peer: str | None = None
        self.released = credit is None  # a 0-byte transfer holds nothing

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._relay._release(self)


class PulledReceived(Received):
    __slots__ = ("_extent", "_pool", "buffer")

    def __init__(
        self, buffer: memoryview, pool: HostPool | None, extent: HostExtent | None
    ) -> None:
        self.buffer = buffer
        self._pool = pool
        self._extent = extent

    def release(self) -> None:
        self.buffer = EMPTY_VIEW
        pool, extent, self._pool, self._extent = self._pool, self._extent, None, None
        if pool is not None and extent is not None:
            pool.free(extent)
