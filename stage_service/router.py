"""Where a stage process sends an item: to a stage it hosts (by reference, no gRPC, no
relay), or to a replica elsewhere over a Deliver channel, one channel per address.

Which replica: `route_index` of the request, or of its conversation
(omnirail/wire/routing.py), what every producer computes, except that a stream stays on
the replica its first chunk went to while that replica is in the topology. The topology is
the coordinator's; a channel whose address lost its replica, or got a new one, is closed
with what it still held.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from omnirail.relay.base import Relay, Releasable
from omnirail.stage_service.edge_sender import LocalValue
from omnirail.transport.deliver import CredentialsFn, DeliverChannel
from omnirail.transport.security import MeshSecurity
from omnirail.v1 import mesh_pb2
from omnirail.wire.errors import OmniError
from omnirail.wire.routing import route_index

# Streams whose replica this process remembers (the oldest are forgotten first).
MAX_STICKY_STREAMS = 8192

# (request ids, why, stage): items that cannot reach their stage; their requests fail.
LostFn = Callable[[list[str], str, str], None]


class ProcessRouter:
    """The `Router` every stage of one process sends through (stage_service/routing.py)."""

    def __init__(
        self,
        pipeline: Any,
        stages: Mapping[str, Any],
        replica_id: str,
        on_lost: LostFn,
        *,
        max_message_bytes: int,
        security: MeshSecurity,
        credentials: CredentialsFn | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._stages = stages  # the host's, by name (filled as they start)
        self._replica_id = replica_id
        self._on_lost = on_lost
        self._max_message = max_message_bytes
        self._security = security
        self._credentials = credentials
        self.topology: dict[str, list[str]] = {}
        self._address_stage: dict[str, str] = {}
        self.channels: dict[str, DeliverChannel] = {}
        # The replica at each address in the last topology (channels open only after one).
        self._replica_at: dict[str, str] = {}
        # (request, target stage) -> the replica address its stream goes to (`route`).
        self._streams_to: OrderedDict[tuple[str, str], str] = OrderedDict()
        # Local deliveries in flight (kept so they are not collected before they run).
        self._local_tasks: set[asyncio.Task[None]] = set()
        # Channels closing after a topology change (kept until they are closed).
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def busy(self) -> bool:
        """Something sent is not acknowledged yet, or a local delivery still runs."""
        return any(c.inflight for c in self.channels.values()) or bool(self._local_tasks)

    def deliver(
        self,
        item: mesh_pb2.DeliverItem,
        handle: Releasable | None,
        local: LocalValue | None = None,
    ) -> None:
        stage = self._stages.get(item.to_stage)
        if stage is not None:
            self._deliver_here(stage, item, handle, local)
            return
        endpoints = self.topology.get(item.to_stage)
        if not endpoints:
            if handle is not None:
                handle.release()
            self._on_lost(
                [item.request_id], f"no live replica of stage {item.to_stage!r}", item.to_stage
            )
            return
        address = self.route(item, endpoints)
        channel = self.channels.get(address)
        if channel is None:
            channel = DeliverChannel(
                address,
                self._replica_id,
                lambda rids, why, a=address: self._on_lost(
                    rids, why, self._address_stage.get(a, "")
                ),
                max_message_bytes=self._max_message,
                security=self._security,
                credentials=self._credentials,
            )
            self.channels[address] = channel
        channel.send(item, handle)

    def route(self, item: mesh_pb2.DeliverItem, endpoints: list[str]) -> str:
        """The replica of `item.to_stage` for this item: by its request id, or its
        conversation's (`route_index`), what every producer computes (a fan-in's producers
        agree without asking). A stream
        stays where its first chunk went while that replica is in the topology: when a
        replica joins, n changes, and a stream moved mid-way would reach a replica that
        never saw its start."""
        if not item.HasField("stream"):
            return endpoints[route_index(item.request_id, item.meta.conversation_id, endpoints)]
        key = (item.request_id, item.to_stage)
        address = self._streams_to.get(key)
        if address is None or address not in endpoints:
            address = endpoints[route_index(item.request_id, item.meta.conversation_id, endpoints)]
        signal = item.stream
        if signal.done or signal.HasField("error"):  # the stream's last item
            self._streams_to.pop(key, None)
            return address
        self._streams_to[key] = address
        self._streams_to.move_to_end(key)
        if len(self._streams_to) > MAX_STICKY_STREAMS:
            self._streams_to.popitem(last=False)
        return address

    def _deliver_here(
        self,
        stage: Any,
        item: mesh_pb2.DeliverItem,
        handle: Releasable | None,
        local: LocalValue | None,
    ) -> None:
        """Hands `item` to a stage of this process. A task per item, started in order: a
        local item never waits inside `on_item` (nothing to read), so each runs to its end
        in turn and order per (request, edge) holds; and the sender's own call (often
        inside its outbox callback) is never re-entered by the receiver's work."""

        def ack(error: OmniError | None) -> None:
            # An error was already reported by the receiver (it fails the request); the
            # ack only returns the sender's stream credit.
            if handle is not None:
                handle.release()

        task = asyncio.get_running_loop().create_task(stage.on_item(item, ack, local))
        self._local_tasks.add(task)
        task.add_done_callback(self._local_tasks.discard)

    def possible_stages(self, terminals: tuple[str, ...]) -> frozenset[str]:
        return self._pipeline.possible_stages(terminals)

    def set_topology(self, topology: mesh_pb2.Topology, relays: Mapping[str, Relay]) -> None:
        """The coordinator's new topology: where items go from now on, and the relay
        peers each backend may reach."""
        self.topology = {
            name: [e.address for e in eps.endpoints] for name, eps in topology.stages.items()
        }
        self._address_stage = {a: name for name, addrs in self.topology.items() for a in addrs}
        stages = topology.stages.values()
        self._retire_channels({e.address: e.replica_id for eps in stages for e in eps.endpoints})
        # Draining replicas take no new work but still send what they finish: their
        # relays stay reachable.
        groups = (*stages, *topology.draining.values())
        infos = list(
            dict.fromkeys(info for eps in groups for ep in eps.endpoints for info in ep.relay_infos)
        )
        for relay in relays.values():
            relay.set_peers(infos)

    def forget(self, request_id: str) -> None:
        """An aborted request: its streams' replicas and its items still queued go."""
        for target in self.topology:
            self._streams_to.pop((request_id, target), None)
        for channel in self.channels.values():
            channel.forget_request(request_id)

    def _retire_channels(self, replicas: dict[str, str]) -> None:
        """Closes channels whose address lost its replica or got a new one (a restart at
        the same address): what they still hold went to the old process, and a stream
        opened while the address was down must not carry the new replica's traffic."""
        for address in list(self.channels):
            if self._replica_at.get(address) == replicas.get(address):
                continue
            channel = self.channels.pop(address)
            gone = f"replica at {address} was replaced or went away"
            task = asyncio.get_running_loop().create_task(channel.close(gone))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self._replica_at = replicas

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        for channel in self.channels.values():
            await channel.close()
