"""The shm relay's transfer handles: the sender's (`ShmHandle`: an extent of its pool and
the edge credit it holds), the receiver's (`ShmReceived`: a read-only view; releasing it
writes the transfer's release mark into the sender's marks segment) and a forwarding
stage's (`ShmForward`: a received view handed on, see omnirail/relay/shm.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnirail.relay.base import Received, RelayHandle
from omnirail.relay.credits import EdgeCredit
from omnirail.relay.shm_pool import GRANT_FORWARDER, MARK_SLOTS, Extent, grant_index
from omnirail.v1 import common_pb2

if TYPE_CHECKING:
    from omnirail.relay.shm import ShmRelay

# A transfer's release-mark slot: the low bits of its id.
SLOT_BITS = 16
SLOT_MASK = (1 << SLOT_BITS) - 1
assert MARK_SLOTS == 1 << SLOT_BITS


class ShmHandle(RelayHandle):
    __slots__ = (
        "_edge",
        "_extent",
        "_relay",
        "descriptor",
        "nbytes",
        "released",
        "request_id",
        "slot",
        "transfer_id",
    )
    acked_in_band = False

    def __init__(
        self,
        relay: ShmRelay,
        descriptor: common_pb2.RelayDescriptor,
        request_id: str,
        edge: EdgeCredit,
        extent: Extent,
        nbytes: int,
        transfer_id: int,
    ) -> None:
        self._relay = relay
        self.descriptor = descriptor
        self.request_id = request_id
        self._edge = edge
        self._extent = extent
        self.nbytes = nbytes
        self.released = False
        self.transfer_id = transfer_id  # a plain int: reading the proto field costs more
        self.slot = transfer_id & SLOT_MASK

    def release(self) -> None:
        """Frees the extent and returns the edge credit; idempotent."""
        if not self.released:
            self.released = True
            self._relay._release(self)


class ShmReceived(Received):
    __slots__ = (
        "_held",
        "_marks",
        "_slot",
        "addr",
        "buffer",
        "forward",
        "offset",
        "region",
        "transfer_id",
    )

    def __init__(
        self,
        buffer: memoryview,
        marks: memoryview | None,
        transfer_id: int,
        held: set[ShmReceived] | None = None,
        region: str = "",
        offset: int = 0,
        addr: int = 0,
    ) -> None:
        self.buffer = buffer
        self._marks = marks
        self._slot = transfer_id & SLOT_MASK
        self.transfer_id = transfer_id
        # Where the view lies (segment, offset, address in this process), so a stage that
        # passes the bytes on can forward them; `held` is the relay's set of live views.
        self._held = held
        self.region = region
        self.offset = offset
        self.addr = addr
        self.forward: ShmForward | None = None  # set once the view has been handed on
        if held is not None:
            held.add(self)

    def release(self) -> None:
        """Marks the transfer done for the sender (unless it was forwarded: the final
        receiver marks it then); idempotent."""
        # Drops our reference only: the mapping stays cached for the next transfer, and
        # views the caller still holds keep it mapped even if the relay closes.
        self.buffer = _EMPTY
        if self._held is not None:
            self._held.discard(self)
            self._held = None
        if self.forward is not None:
            self.forward.handed_on()
            self._marks = None
            return
        self.mark()

    def tag_forward(self, tag: int) -> None:
        """Records in the sender's grant that this process hands the transfer on: the
        next receiver accepts the descriptor from it (omnirail/relay/shm.py, "Trust")."""
        if self._marks is not None:
            self._marks[grant_index(self._slot) + GRANT_FORWARDER] = tag

    def mark(self) -> None:
        """Writes the release mark (once): the sender may reuse the bytes."""
        marks, self._marks = self._marks, None
        if marks is not None:
            marks[self._slot] = self.transfer_id


class ShmForward(RelayHandle):
    """A received view handed on to the next stage (see the module docstring).

    Until the forwarding stage releases its own view, `release()` (an abort, or a delivery
    that failed) marks the original transfer done; after that the receiver owns the mark.
    """

    __slots__ = ("_forwards", "_received", "descriptor", "nbytes", "request_id")
    acked_in_band = False

    def __init__(
        self,
        descriptor: common_pb2.RelayDescriptor,
        request_id: str,
        received: ShmReceived,
        forwards: set[ShmForward],
    ) -> None:
        self.descriptor = descriptor
        self.request_id = request_id
        self.nbytes = descriptor.nbytes
        self._received: ShmReceived | None = received
        self._forwards: set[ShmForward] | None = forwards
        forwards.add(self)

    def release(self) -> None:
        """Returns the bytes to their sender if this stage still answers for them."""
        received = self._received
        self.handed_on()
        if received is not None:
            received.mark()

    def handed_on(self) -> None:
        """The forwarding stage is done with the view: the receiver answers for it now."""
        self._received = None
        if self._forwards is not None:
            self._forwards.discard(self)
            self._forwards = None


_EMPTY = memoryview(b"")
