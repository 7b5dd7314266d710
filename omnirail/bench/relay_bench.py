"""Cross-process relay benchmark: put -> descriptor over a socket -> get -> ack -> release.

The sender (this process) streams payloads of one uint8 tensor through a real relay backend
and `omnirail.relay.io`; a receiver process (`python -m omnirail.bench.relay_bench --receiver`)
decodes each with zero-copy views, touches one byte per tensor and releases it.
Descriptors travel as small length-prefixed msgpack frames over a socketpair, batched like a
stream writer batches what is ready. Throughput is pipelined up to the edge credits (best of
`repeat` runs of at least `min_seconds`); as in a mesh, the receiver acks transfers only for
backends that return credit through acks (the others learn of releases themselves: shm
marks, nixl/ucx/gloo release messages), and a sync frame ends each run. Latency is the
median round trip of one transfer at a time, put to the receiver's ack. `memcpy_gbps` is
numpy copyto between two warm arrays of the same size, measured between the relay runs so
both see the same machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

import msgpack
import numpy as np

from omnirail.relay.io import relayed_payload
from omnirail.v1 import common_pb2
from omnirail.wire.payload import Packed, pack

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
_LEN = struct.Struct("<I")
_MIN_TRANSFERS = 5
_LATENCY_SAMPLES = 50
_EDGE = "bench"
# _DATA items are acked one by one; _QUIET items are not (the relay returns their credit).
_DATA, _STOP, _PEERS, _STATS, _QUIET, _SYNC = 0, 1, 2, 3, 4, 5
_CONNECT_TIMEOUT_S = 120.0
# Descriptors per frame, and payload bytes after which a frame goes out anyway (so large
# transfers are not held back). Acks: at most this many per frame.
_BATCH = 8
_BATCH_BYTES = 4 << 20
_ACK_EVERY = 16


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj)
    return _LEN.pack(len(body)) + body


def _split_frames(buf: bytearray) -> list[Any]:
    """Removes every complete frame from `buf` and returns them decoded."""
    out, pos = [], 0
    while len(buf) - pos >= 4:
        (n,) = _LEN.unpack_from(buf, pos)
        if len(buf) - pos - 4 < n:
            break
        out.append(msgpack.unpackb(buf[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    del buf[:pos]
    return out


# ----------------------------------------------------------------------------- receiver


async def _receiver_main(sock: socket.socket, backend: str, settings: Any) -> None:
    from omnirail.relay.base import create_relay
    from omnirail.relay.io import receive_payload

    relays = {backend: create_relay(backend, settings)}
    # Hello: what the sender needs to know about us (nixl metadata, UCX listener, rank).
    sock.sendall(_frame([relays[backend].local_info()]))
    buf = bytearray()
    acks: list[int] = []
    gets: list[float] = []
    try:
        while True:
            # Ack when nothing more is waiting (or enough is done): every ack frame wakes
            # the sender, and wakeups across cores cost more than the work on small sizes.
            try:
                chunk = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if acks:
                    sock.sendall(_frame(acks))
                    acks = []
                chunk = sock.recv(1 << 16)
            if not chunk:
                return
            buf += chunk
            for kind, items in _split_frames(buf):
                if kind == _STOP:
                    return
                if kind == _PEERS:
                    relays[backend].set_peers(items)
                    await relays[backend].connect(_CONNECT_TIMEOUT_S)
                    sock.sendall(_frame([]))  # ready (an empty ack list)
                    continue
                if kind == _SYNC:  # everything before it is received and released
                    sock.sendall(_frame({"synced": True}))
                    continue
                if kind == _STATS:
                    # The relay's own share of a transfer: get + release, as this side saw it.
                    get_us = statistics.median(gets) * 1e6 if gets else 0.0
                    gets.clear()
                    sock.sendall(_frame({"get_us": get_us}))
                    continue
                for raw in items:
                    pb = common_pb2.Payload.FromString(raw)
                    t0 = time.perf_counter()
                    received = await receive_payload(pb, relays)
                    value = received.value
                    # Touch one byte so the data is really reachable from this process.
                    _ = value.numpy()[0] if hasattr(value, "numpy") else value[0]
                    received.release()
                    gets.append(time.perf_counter() - t0)
                    if kind == _DATA:
                        acks.append(pb.relay.transfer_id)
            if len(acks) >= _ACK_EVERY:
                sock.sendall(_frame(acks))
                acks = []
    finally:
        for relay in relays.values():
            relay.close()


# ----------------------------------------------------------------------------- sender


class _Link:
    """Sender end of the socket: sends descriptor frames, releases handles on acks.

    Descriptors go out in frames of up to `_BATCH` (or `_BATCH_BYTES` of payload), and at
    the latest when the sender yields, so a sender blocked on credits never withholds them.
    Acks are read without yielding after each frame, so extents come back as soon as the
    receiver is done and the few in flight stay warm in cache; a loop reader handles them
    while the sender is blocked.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.pending_bytes = 0
        self.buf = bytearray()
        self.handles: dict[int, Any] = {}
        self.pending: list[bytes] = []
        self.pending_kind = _DATA
        self.flush_scheduled = False
        self.idle: asyncio.Future[None] | None = None
        self.lost: BaseException | None = None
        self.stats: asyncio.Future[dict] | None = None
        self.unsynced = False  # _QUIET items sent since the last sync
        asyncio.get_running_loop().add_reader(sock.fileno(), self.poll)

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()

    def write(self, data: bytes) -> None:
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            # Frames are small; a full socket buffer means the receiver lags: wait for it.
            self.sock.setblocking(True)
            try:
                self.sock.sendall(data[sent:])
            finally:
                self.sock.setblocking(False)

    def queue(self, raw: bytes, nbytes: int, kind: int) -> None:
        if self.pending and kind != self.pending_kind:
            self.flush()
        self.pending_kind = kind
        self.pending.append(raw)
        self.pending_bytes += nbytes
        if len(self.pending) >= _BATCH or self.pending_bytes >= _BATCH_BYTES:
            self.flush()
            if self.handles:  # acks are due (quiet items get none)
                self.poll()
        elif not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.pending:
            self.write(_frame([self.pending_kind, self.pending]))
            self.pending = []
            self.pending_bytes = 0

    def poll(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as e:
            data, self.lost = b"", e
        if not data:
            self.lost = self.lost or ConnectionError("receiver closed the connection")
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            if self.idle is not None and not self.idle.done():
                self.idle.set_exception(self.lost)
            return
        self.buf += data
        for ids in _split_frames(self.buf):
            if isinstance(ids, dict):  # the answer to a stats or sync request
                if self.stats is not None and not self.stats.done():
                    self.stats.set_result(ids)
                continue
            for tid in ids:
                self.handles.pop(tid).release()
        if not self.handles and self.idle is not None and not self.idle.done():
            self.idle.set_result(None)

    def send_nowait(self, relay: Any, value: Any, acked: bool) -> Packed | None:
        """Sends `value` if the relay can put it without waiting, as a stage does (no
        coroutine on that path); else returns it packed for `send`."""
        packed = pack(value)
        handle = relay.put_nowait(packed, "bench", _EDGE)
        if handle is None:
            return packed
        self._queue_put(packed, handle, acked)
        return None

    async def send(self, relay: Any, value: Any, acked: bool) -> None:
        """Puts `value` like a stage does; when `acked`, the receiver acks it and the ack
        releases the handle."""
        packed = self.send_nowait(relay, value, acked)
        if packed is not None:
            await self.send_waiting(relay, packed, acked)

    async def send_waiting(self, relay: Any, packed: Packed, acked: bool) -> None:
        """Sends what `send_nowait` could not: waits for the relay's put."""
        self._queue_put(packed, await relay.put(packed, "bench", _EDGE), acked)

    def _queue_put(self, packed: Packed, handle: Any, acked: bool) -> None:
        raw = relayed_payload(packed, handle).SerializeToString()
        if acked:
            self.handles[handle.descriptor.transfer_id] = handle
            self.queue(raw, packed.nbytes, _DATA)
        else:
            self.unsynced = True
            self.queue(raw, packed.nbytes, _QUIET)

    async def receiver_stats(self) -> dict:
        """The receiver's figures since the last call (and resets them)."""
        return await self._ask(_STATS)

    async def _ask(self, kind: int) -> dict:
        self.stats = asyncio.get_running_loop().create_future()
        self.write(_frame([kind, []]))
        return await asyncio.wait_for(self.stats, 60)

    async def drained(self) -> None:
        """Returns once the receiver has received and released everything sent."""
        self.flush()
        if self.lost:
            raise self.lost
        if self.handles:
            self.idle = asyncio.get_running_loop().create_future()
            await self.idle
        if self.unsynced:
            await self._ask(_SYNC)
            self.unsynced = False


def _figure(value: float) -> float:
    """`value` to 4 significant digits: a fixed 3 decimals turned a slow small-size rate
    (4 KiB through gloo on a busy host, under 0.0005 GB/s) into 0."""
    return float(f"{value:.4g}")


async def _throughput(link: _Link, relay: Any, value: Any, secs: float) -> int:
    """Transfers done in a pipelined run of at least `secs`; the caller times it."""
    n = 0
    acked = relay.acks_in_band
    t0 = time.perf_counter()
    while n < _MIN_TRANSFERS or time.perf_counter() - t0 < secs:
        # The coroutine only when the put must wait (a full edge), as on a stage.
        packed = link.send_nowait(relay, value, acked)
        if packed is not None:
            await link.send_waiting(relay, packed, acked)
        n += 1
    await link.drained()
    return n


async def _latency(link: _Link, relay: Any, value: Any, samples: int) -> float:
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        await link.send(relay, value, True)
        await link.drained()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class Memcpy:
    """numpy copyto between two warm arrays of one size; best GB/s over its windows."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.src = np.ones(size, np.uint8)
        self.dst = np.empty(size, np.uint8)
        np.copyto(self.dst, self.src)
        self.best = 0.0

    def measure(self, secs: float) -> None:
        n, t0 = 0, time.perf_counter()
        while n < _MIN_TRANSFERS or time.perf_counter() - t0 < secs:
            np.copyto(self.dst, self.src)
            n += 1
        self.best = max(self.best, n * self.size / (time.perf_counter() - t0) / 1e9)


class DeviceCopy:
    """The same on a GPU: `copy_` between two tensors on `device`, synchronized; the
    reference for GPU tensors (which `pack` stages through host memory)."""

    def __init__(self, size: int, device: str) -> None:
        import torch

        self._torch = torch
        self.size = size
        self.src = torch.ones(size, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        torch.cuda.synchronize(device)
        self.device = device
        self.best = 0.0

    def measure(self, secs: float) -> None:
        n, t0 = 0, time.perf_counter()
        while n < _MIN_TRANSFERS or time.perf_counter() - t0 < secs:
            self.dst.copy_(self.src)
            n += 1
        self._torch.cuda.synchronize(self.device)
        self.best = max(self.best, n * self.size / (time.perf_counter() - t0) / 1e9)


def check_device(device: str) -> str:
    """`device` if tensors can be made there: "cpu", or "cuda"/"cuda:N" with CUDA present."""
    if device == "cpu":
        return device
    if device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, not {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: torch {torch.__version__} sees no CUDA device on this host"
        )
    return device


def check_relay_args(
    backend: str, sizes: list[int] | None, options: dict, receiver_options: dict
) -> None:
    """Refuses (ValueError) what the bench cannot run, before a receiver is started: an
    unknown backend, `inline` (it carries no bytes outside the message), sizes below one
    byte, and options the backend does not take, on either side."""
    from omnirail.relay import registry
    from omnirail.relay.options import option_problems

    model = registry.options_model(backend)
    if model is None:
        known = ", ".join(name for name in registry.BACKENDS if name != "inline")
        raise ValueError(f"--backend {backend!r}: no such relay backend (known: {known})")
    if backend == "inline":
        raise ValueError(
            "--backend inline: it carries payloads inside the control message, so there is "
            "no transfer to measure; the bench measures shm, nixl, ucx and torchdist"
        )
    bad = [n for n in sizes or () if n < 1]
    if bad:
        raise ValueError(f"--sizes: byte counts must be at least 1, got {bad[0]}")
    for flag, opts in (("--option", options), ("--receiver-option", receiver_options)):
        problems = option_problems(backend, model, {**options, **opts})
        if problems:
            raise ValueError(f"{flag}: " + "; ".join(f"{key}: {why}" for key, why in problems))


def _read_frame(sock: socket.socket, buf: bytearray) -> Any:
    while True:
        frames = _split_frames(buf)
        if frames:
            assert len(frames) == 1, "the receiver sent more than one start-up frame"
            return frames[0]
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the receiver exited during start-up")
        buf += chunk


async def _introduce(relay: Any, sock: socket.socket) -> None:
    """Exchanges relay infos with the receiver and waits until both sides are connected."""
    buf = bytearray()
    (info,) = await asyncio.to_thread(_read_frame, sock, buf)
    relay.set_peers([relay.local_info(), info])
    sock.sendall(_frame([_PEERS, [relay.local_info()]]))
    await relay.connect(_CONNECT_TIMEOUT_S)
    ready = await asyncio.to_thread(_read_frame, sock, buf)
    assert ready == [], ready


def _receiver_settings(backend: str, relay: Any, settings: Any, overrides: dict) -> Any:
    """The receiver's settings: the sender's, paired where the backend needs it
    (torchdist ranks), with the receiver's own option overrides."""
    if backend == "torchdist":
        from omnirail.relay.torchdist import pair_settings

        settings = pair_settings(relay, settings, 1)
    if overrides:
        settings = dataclasses.replace(settings, options={**settings.options_dict(), **overrides})
    return settings


async def _bench(
    backend: str,
    sizes: list[int],
    min_seconds: float,
    repeat: int,
    settings: Any,
    receiver_options: dict,
    receiver_wrap: list[str],
    device: str = "cpu",
) -> dict:
    import torch

    from omnirail.relay.base import create_relay

    relay = create_relay(backend, settings)
    peer_settings = _receiver_settings(backend, relay, settings, receiver_options)
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [
            *receiver_wrap,
            sys.executable,
            "-m",
            "omnirail.bench.relay_bench",
            "--receiver",
            f"--fd={theirs.fileno()}",
            f"--backend={backend}",
            f"--settings={json.dumps(peer_settings.as_dict())}",
        ],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    results: dict[str, Any] = {}
    try:
        await _introduce(relay, ours)
    except BaseException:
        relay.close()
        ours.close()
        proc.kill()
        proc.wait()
        raise
    link = _Link(ours)
    try:
        for size in sizes:
            value = torch.ones(size, dtype=torch.uint8, device=device)
            # Warm the pool pages and the receiver's mapping before timing.
            await _throughput(link, relay, value, min(0.2, min_seconds))
            best, transfers = 0.0, 0
            memcpy: Memcpy | DeviceCopy = (
                Memcpy(size) if device == "cpu" else DeviceCopy(size, device)
            )
            for _ in range(repeat):
                t0 = time.perf_counter()
                n = await _throughput(link, relay, value, min_seconds)
                gbps = n * size / (time.perf_counter() - t0) / 1e9
                if gbps > best:
                    best, transfers = gbps, n
                memcpy.measure(min(min_seconds, 0.2))
            samples = max(3, min(_LATENCY_SAMPLES, int(min_seconds * 2e9 / size)))
            await link.receiver_stats()  # drop the throughput runs' figures
            latency = await _latency(link, relay, value, samples)
            get_us = (await link.receiver_stats())["get_us"]
            results[str(size)] = {
                "bytes": size,
                "gbps": _figure(best),
                "memcpy_gbps": _figure(memcpy.best),
                "ratio": _figure(best / memcpy.best),
                "latency_us": round(latency, 1),
                # Receiver-side get + release alone (no descriptor or ack hop).
                "get_us": round(get_us, 1),
                "transfers": transfers,
            }
            del value, memcpy
        link.write(_frame([_STOP, []]))
    finally:
        link.close()
        relay.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "backend": backend,
        "options": settings.options_dict(),
        "device": device,
        # What `memcpy_gbps` and `ratio` compare with: a copy on the tensors' own device.
        "reference": "memcpy" if device == "cpu" else "device_to_device_copy",
        "sizes": results,
    }


def run_relay_bench(
    backend: str = "shm",
    sizes: list[int] | None = None,
    min_seconds: float = 0.5,
    repeat: int = 3,
    options: dict | None = None,
    receiver_options: dict | None = None,
    receiver_wrap: list[str] | None = None,
    device: str = "cpu",
) -> dict:
    """Measures cross-process put->get throughput (GB/s) and latency per payload size.

    `device`: where the sent tensors live ("cuda": GPU tensors, which every backend
    carries staged through host memory; `ratio` is then against a same-run copy on the
    GPU).

    `options`: RelaySettings.options of both sides; `receiver_options` override them on the
    receiver; `receiver_wrap` prefixes the receiver's command (e.g. `ip netns exec NS`, to
    measure across network namespaces).
    """
    from omnirail.relay.base import RelaySettings
    from omnirail.relay.shm import sweep_segments

    device = check_device(device)
    options = dict(options or {})
    check_relay_args(backend, sizes, options, dict(receiver_options or {}))
    prefix = f"omnirail-bench{os.getpid()}"
    ranks: dict[str, int] = {}
    if backend == "torchdist":
        # Two ranks of a fresh group; rank 0 (this process) picks the store's port.
        ranks = {"rank": 0, "world_size": 2}
        options = {"init_method": "tcp://127.0.0.1:0", **options}
    settings = RelaySettings(name_prefix=prefix, options=options, **ranks)
    try:
        return asyncio.run(
            _bench(
                backend,
                sizes or DEFAULT_SIZES,
                min_seconds,
                repeat,
                settings,
                dict(receiver_options or {}),
                list(receiver_wrap or []),
                device,
            )
        )
    finally:
        sweep_segments(prefix)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--sizes", default="", help="comma-separated byte counts")
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.receiver:
        from omnirail.relay.base import RelaySettings

        sock = socket.socket(fileno=args.fd)
        asyncio.run(_receiver_main(sock, args.backend, RelaySettings(**json.loads(args.settings))))
        return
    sizes = [int(s) for s in args.sizes.split(",") if s] or None
    print(json.dumps(run_relay_bench(args.backend, sizes, args.min_seconds, args.repeat), indent=2))


if __name__ == "__main__":
    main()
