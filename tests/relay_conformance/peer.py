"""Receiver process of the relay conformance suite.

Run as `python -m tests.relay_conformance.peer --fd N --backend NAME --settings JSON`. It
creates the same backend as the sender, then serves frames (see `wire`) on the inherited
socket, one at a time and in arrival order:

- get: decode a `common_pb2.Payload`, `relay.get` its descriptor, answer the CRC-32 of the
  bytes read (and, with echo, the value unpacked from the view re-encoded inline), then
  release (or hold the view until a release frame names it).
- release: re-checksum held views (so a sender that reused their extents is caught), then
  release them.
- probe: `relay.get` a bare descriptor (garbage and trust tests) and report what it raised;
  unbound, unless the frame names `owners` or asks for the sender's ids (`as_sender`).
- peers: `relay.set_peers` with the infos sent, then `relay.connect` (the first frame). The
  ids in those infos are the `owners` every get passes, as the Deliver stream passes its
  authenticated sender's (backends whose `get` takes no owners yet get none).

Replies carry `bytes_in`: the payload bytes the receiver relay fetched so far (pulled
backends count them), so a test sees that a refused get read nothing.
- stop: close the relay and exit 0.

The reply to a get is sent only after the view is released, so a sender that sees the reply
may rely on the release having happened (acks in band or release marks alike).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import socket
import time
import zlib
from typing import Any

import msgpack

from omnirail.relay.base import Received, Relay, RelayError, RelaySettings, create_relay
from omnirail.v1 import common_pb2
from omnirail.wire.payload import encode_inline, unpack
from tests.relay_conformance import wire


def _failure(seq: int, exc: BaseException, started: float) -> dict[str, Any]:
    return {
        "seq": seq,
        "ok": False,
        "error": type(exc).__name__,
        "relay_error": isinstance(exc, RelayError),
        "message": str(exc),
        "elapsed": time.monotonic() - started,
    }


def owner_ids(infos: list[bytes]) -> frozenset[str] | None:
    """The relay peer ids in `infos` (the sender's `local_info()`s); None when none has one."""
    ids = set()
    for raw in infos:
        try:
            info = msgpack.unpackb(raw, raw=False)
        except Exception:
            continue
        if isinstance(info, dict) and isinstance(info.get("id"), str):
            ids.add(info["id"])
    return frozenset(ids) or None


def takes_owners(relay: Relay) -> bool:
    return "owners" in inspect.signature(relay.get).parameters


class _Server:
    def __init__(self, relay: Relay, writer: asyncio.StreamWriter) -> None:
        self.relay = relay
        self.writer = writer
        self.held: dict[int, Received] = {}
        self.owners: frozenset[str] | None = None

    async def reply(self, msg: dict[str, Any]) -> None:
        msg.setdefault("bytes_in", getattr(self.relay, "bytes_in", None))
        self.writer.write(wire.encode(msg))
        await self.writer.drain()

    async def fetch(
        self, descriptor: common_pb2.RelayDescriptor, owners: frozenset[str] | None
    ) -> Received:
        if owners is not None and takes_owners(self.relay):
            return await self.relay.get(descriptor, owners)  # type: ignore[call-arg]
        return await self.relay.get(descriptor)

    async def get(self, msg: dict[str, Any]) -> dict[str, Any]:
        seq, started = msg["seq"], time.monotonic()
        pb = common_pb2.Payload.FromString(msg["payload"])
        try:
            received = await self.fetch(pb.relay, self.owners)
        except Exception as e:  # reported to the sender, which decides what it expected
            return _failure(seq, e, started)
        out: dict[str, Any] = {
            "seq": seq,
            "ok": True,
            "transfer_id": pb.relay.transfer_id,
            "nbytes": pb.relay.nbytes,
            "length": len(received.buffer),
            "readonly": received.buffer.readonly,
            "crc": zlib.crc32(received.buffer),
            "echo": None,
        }
        try:
            if msg.get("echo"):
                value = unpack(pb.header, received.buffer)
                out["echo"] = encode_inline(value).SerializeToString()
                del value  # its views must not outlive the release below
        except Exception as e:
            received.release()
            return _failure(seq, e, started)
        if msg.get("hold"):
            self.held[seq] = received
        else:
            received.release()
        return out

    def release(self, msg: dict[str, Any]) -> dict[str, Any]:
        crcs = {}
        for seq in msg["seqs"]:
            received = self.held.pop(seq)
            crcs[seq] = zlib.crc32(received.buffer)
            received.release()
        return {"seq": msg["seq"], "ok": True, "crcs": crcs}

    async def probe(self, msg: dict[str, Any]) -> dict[str, Any]:
        seq, started = msg["seq"], time.monotonic()
        desc = common_pb2.RelayDescriptor.FromString(msg["descriptor"])
        # Garbage probes go unbound (so they reach the backend's own checks); trust probes
        # name the owners, or ask for the sender's ids.
        owners = frozenset(msg["owners"]) if msg.get("owners") is not None else None
        if msg.get("as_sender"):
            owners = self.owners
        try:
            received = await self.fetch(desc, owners)
        except Exception as e:
            return _failure(seq, e, started)
        crc = zlib.crc32(received.buffer)
        received.release()
        return {"seq": seq, "ok": True, "crc": crc, "elapsed": time.monotonic() - started}


async def _serve(fd: int, backend: str, settings: RelaySettings) -> None:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        relay = create_relay(backend, settings)
    except Exception as e:
        writer.write(wire.encode(_failure(0, e, time.monotonic())))
        await writer.drain()
        raise
    server = _Server(relay, writer)
    try:
        hello = {"seq": 0, "ok": True, "pid": os.getpid(), "info": relay.local_info()}
        await server.reply(hello)
        while True:
            try:
                msg = await wire.read(reader)
            except asyncio.IncompleteReadError:
                return  # the sender went away
            op = msg["op"]
            if op == "stop":
                return
            if op == "get":
                await server.reply(await server.get(msg))
            elif op == "release":
                await server.reply(server.release(msg))
            elif op == "probe":
                await server.reply(await server.probe(msg))
            elif op == "peers":
                relay.set_peers(list(msg["infos"]))
                await relay.connect(float(msg["timeout"]))
                server.owners = owner_ids(list(msg["infos"]))
                bound = server.owners is not None and takes_owners(relay)
                await server.reply({"seq": msg["seq"], "ok": True, "bound": bound})
            else:
                raise ValueError(f"unknown op {op!r}")
    finally:
        for received in server.held.values():
            received.release()
        relay.close()
        writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--settings", required=True, help="RelaySettings fields as JSON")
    args = parser.parse_args()
    settings = RelaySettings(**json.loads(args.settings))
    asyncio.run(_serve(args.fd, args.backend, settings))


if __name__ == "__main__":
    main()
