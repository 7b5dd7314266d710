"""Sender side of the conformance harness: a `Peer` is a receiver process plus the link to it.

The test process is the sender: `Peer.put` puts a value into the sender relay and sends the
descriptor (a serialized `common_pb2.Payload`) to the receiver process, which answers with
what it read. Handles of backends that ack in band are released when that answer arrives,
as the Deliver stream does; other backends learn of releases by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnirail.relay.base import Relay, RelayHandle, RelaySettings
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed, pack
from tests.relay_conformance import wire
from tests.relay_conformance.backends import BackendSpec

# Generous: the suite runs on busy 2-core machines. Only bounds hangs, never paces a test.
TIMEOUT = 120.0
ROOT = Path(__file__).resolve().parents[2]


class PeerGone(ConnectionError):
    """The receiver process exited or closed the link."""


@dataclass
class Reply:
    """What the receiver saw for one frame (see `peer`)."""

    seq: int
    ok: bool
    transfer_id: int = 0
    nbytes: int = 0
    length: int = 0
    readonly: bool = False
    crc: int | None = None
    echo: bytes | None = None
    crcs: dict[int, int] = dataclasses.field(default_factory=dict)
    error: str = ""
    relay_error: bool = False
    message: str = ""
    elapsed: float = 0.0
    bytes_in: int | None = None  # payload bytes the receiver relay fetched so far
    bound: bool = False  # peers: whether its gets pass the sender's ids as owners


@dataclass
class Transfer:
    """One put whose descriptor went to the receiver."""

    seq: int
    handle: RelayHandle
    request_id: str
    nbytes: int
    crc: int  # CRC-32 of the packed bytes the sender put
    hold: bool
    reply: asyncio.Future[Reply]

    async def result(self) -> Reply:
        return await asyncio.wait_for(asyncio.shield(self.reply), TIMEOUT)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Seeded random bytes: a misplaced or stale extent cannot match by accident."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)


def crc_of(packed: Packed) -> int:
    return zlib.crc32(packed.to_bytes())


class Peer:
    def __init__(
        self,
        spec: BackendSpec,
        relay: Relay,
        proc: subprocess.Popen[bytes],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.spec = spec
        self.relay = relay  # the sender relay
        self.proc = proc
        self._reader = reader
        self._writer = writer
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._transfers: dict[int, Transfer] = {}
        self._gone = asyncio.Event()
        self._killed = False
        self._task: asyncio.Task[None] | None = None
        self.info = b""  # the receiver relay's local_info()
        # Whether the receiver's gets pass `owners` (the sender's ids), as a stage does.
        self.bound = False

    @classmethod
    async def start(cls, spec: BackendSpec, relay: Relay, settings: RelaySettings) -> Peer:
        ours, theirs = socket.socketpair()
        path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        args = ["--fd", str(theirs.fileno()), "--backend", spec.name]
        args += ["--settings", json.dumps(settings.as_dict())]
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.relay_conformance.peer", *args],
            pass_fds=[theirs.fileno()],
            cwd=ROOT,
            env=env,
        )
        theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        peer = cls(spec, relay, proc, reader, writer)
        try:
            hello = await asyncio.wait_for(wire.read(reader), TIMEOUT)
        except BaseException:
            with contextlib.suppress(AssertionError):  # the startup error says more
                await peer.aclose()
            raise
        if not hello["ok"]:
            with contextlib.suppress(AssertionError):
                await peer.aclose()
            raise RuntimeError(f"peer could not create {spec.name!r}: {hello['message']}")
        peer.info = hello.get("info") or b""
        peer._task = asyncio.get_running_loop().create_task(peer._read_loop())
        return peer

    async def introduce(self, infos: list[bytes]) -> None:
        """Hands the receiver the sender-side peer infos and waits for it to connect."""
        seq, fut = self._next()
        self._write({"op": "peers", "seq": seq, "infos": infos, "timeout": TIMEOUT})
        reply = await asyncio.wait_for(fut, TIMEOUT)
        assert reply.ok, f"peer could not connect: {reply.error}: {reply.message}"
        self.bound = reply.bound

    # ------------------------------------------------------------------ transfers

    async def put(
        self,
        value: Any,
        *,
        request_id: str = "req",
        edge: str = "edge",
        hold: bool = False,
        echo: bool = False,
        crc: int | None = None,
    ) -> Transfer:
        """Puts `value` (waiting for credit) and sends its descriptor; returns at once then.

        `crc`: the expected CRC-32 when the caller has it (saves a copy of big payloads).
        """
        packed = value if isinstance(value, Packed) else pack(value)
        handle = await self.relay.put(packed, request_id, edge)
        return self.submit(packed, handle, hold=hold, echo=echo, crc=crc)

    def submit(
        self,
        packed: Packed,
        handle: RelayHandle,
        *,
        hold: bool = False,
        echo: bool = False,
        crc: int | None = None,
    ) -> Transfer:
        """Sends the descriptor of a handle the caller got from the relay itself."""
        pb = common_pb2.Payload(header=packed.header)
        pb.relay.CopyFrom(handle.descriptor)
        seq, fut = self._next()
        transfer = Transfer(
            seq,
            handle,
            handle.request_id,
            packed.nbytes,
            crc if crc is not None else crc_of(packed),
            hold,
            fut,
        )
        self._transfers[seq] = transfer
        msg = {"op": "get", "seq": seq, "hold": hold, "echo": echo}
        self._write({**msg, "payload": pb.SerializeToString()})
        return transfer

    async def send(self, value: Any, **kw: Any) -> Reply:
        """Round trip of one value; asserts the receiver read exactly what was put."""
        transfer = await self.put(value, **kw)
        reply = await transfer.result()
        check(transfer, reply)
        return reply

    async def send_many(self, values: Iterable[Any], **kw: Any) -> list[Reply]:
        """Puts one after the other (pipelined up to the edge's credit), then checks all."""
        transfers = [await self.put(v, **kw) for v in values]
        replies = [await t.result() for t in transfers]
        for transfer, reply in zip(transfers, replies, strict=True):
            check(transfer, reply)
        return replies

    async def release(self, transfers: Iterable[Transfer]) -> dict[int, int]:
        """Has the receiver release held views; returns seq -> CRC-32 read just before."""
        held = list(transfers)
        seq, fut = self._next()
        self._write({"op": "release", "seq": seq, "seqs": [t.seq for t in held]})
        reply = await asyncio.wait_for(fut, TIMEOUT)
        for t in held:
            self._acked(t)
        return reply.crcs

    async def probe(
        self,
        descriptor: common_pb2.RelayDescriptor,
        owners: Iterable[str] | None = None,
        as_sender: bool = False,
    ) -> Reply:
        """Has the receiver `get` a bare descriptor (releasing at once if it succeeds);
        unbound, unless `owners` names the ids it takes as the sender's or `as_sender` asks
        for the real sender's."""
        seq, fut = self._next()
        msg = {"op": "probe", "seq": seq, "descriptor": descriptor.SerializeToString()}
        if owners is not None:
            msg["owners"] = sorted(owners)
        msg["as_sender"] = as_sender
        self._write(msg)
        return await asyncio.wait_for(fut, TIMEOUT)

    # ------------------------------------------------------------------ lifetime

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    def kill(self) -> None:
        """SIGKILL: no release, no goodbye, as a crashed stage process."""
        self._killed = True
        self.proc.send_signal(signal.SIGKILL)

    async def wait_gone(self) -> None:
        """Until the link reports EOF and the process is reaped."""
        await asyncio.wait_for(self._gone.wait(), TIMEOUT)
        await asyncio.to_thread(self.proc.wait, TIMEOUT)

    async def aclose(self) -> None:
        """Stops the receiver (it releases what it holds) and checks it exited cleanly."""
        if self.proc.poll() is None and not self.gone:
            with contextlib.suppress(OSError):
                self._write({"op": "stop"})
        try:
            await asyncio.to_thread(self.proc.wait, TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            await asyncio.to_thread(self.proc.wait)
            raise AssertionError("peer did not stop") from None
        finally:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._writer.close()
            self._lost()
        if not self._killed and self.proc.returncode != 0:
            raise AssertionError(f"peer exited with status {self.proc.returncode}")

    # ------------------------------------------------------------------ internals

    def _next(self) -> tuple[int, asyncio.Future[Reply]]:
        if self.gone:
            raise PeerGone("the peer process is gone")
        self._seq += 1
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[self._seq] = fut
        return self._seq, fut

    def _write(self, msg: dict[str, Any]) -> None:
        if self.gone:
            raise PeerGone("the peer process is gone")
        self._writer.write(wire.encode(msg))

    def _acked(self, transfer: Transfer) -> None:
        # The Deliver stream's rule: in-band handles go back when the receiver's ack arrives.
        self._transfers.pop(transfer.seq, None)
        if transfer.handle.acked_in_band:
            transfer.handle.release()

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await wire.read(self._reader)
                reply = Reply(**msg)
                transfer = self._transfers.get(reply.seq)
                if transfer is not None and reply.ok and not transfer.hold:
                    self._acked(transfer)
                fut = self._waiting.pop(reply.seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._lost()

    def _lost(self) -> None:
        self._gone.set()
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(PeerGone(f"peer exited (status {self.proc.poll()})"))
                fut.exception()  # retrieved: futures nobody awaits must not warn


def check(transfer: Transfer, reply: Reply) -> None:
    """The receiver got exactly the bytes of `transfer`, through a read-only view."""
    assert reply.ok, f"receiver failed: {reply.error}: {reply.message}"
    assert reply.transfer_id == transfer.handle.descriptor.transfer_id
    assert reply.length == reply.nbytes == transfer.nbytes
    assert reply.crc == transfer.crc, f"content differs (seq {transfer.seq})"
    assert reply.readonly, "Received.buffer must be a read-only view"


# ----------------------------------------------------------------------------- probes


def outstanding_probe(relay: Relay) -> Any:
    """`relay.outstanding(edge) -> (transfers, bytes)`, or a skip naming what is missing."""
    probe = getattr(relay, "outstanding", None)
    if probe is None:
        pytest.skip(f"{relay.name} relay exposes no outstanding(edge) to check credit with")
    return probe


async def settled_outstanding(relay: Relay, edge: str, want: tuple[int, int]) -> tuple[int, int]:
    """`outstanding(edge)` once it equals `want`, or as it is after TIMEOUT.

    Backends that do not ack in band learn of releases by themselves, some only when they
    look (shm reads its release marks in `reclaim`), so this lets them look.
    """
    probe = outstanding_probe(relay)
    reclaim = getattr(relay, "reclaim", None)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT
    while True:
        if reclaim is not None:
            reclaim()
        got = tuple(probe(edge))
        # Without new puts credit only comes back, so below `want` it will never match.
        if got == want or got[0] < want[0] or got[1] < want[1] or loop.time() > deadline:
            return got  # type: ignore[return-value]
        await asyncio.sleep(0.005)


async def still_blocked(task: asyncio.Task[Any]) -> bool:
    """True when `task` has not finished after the loop ran everything else for a while.

    Used only to assert that something does *not* happen: a slow machine cannot make a
    blocked put complete, so the short pause cannot cause a false failure.
    """
    for _ in range(20):
        await asyncio.sleep(0.01)
    return not task.done()
