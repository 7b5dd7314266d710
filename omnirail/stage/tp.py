"""Tensor-parallel stages: `tp_size: N` runs N rank processes joined in one
`torch.distributed` group (NCCL on GPUs, gloo on the CPU).

Rank 0 is the stage process the mesh sees (Deliver, Attach, relays, its scheduler). The
other ranks follow its schedule: every call a stage shares across ranks (`shared`) is
broadcast by rank 0, with its arguments, over a gloo control group, and each follower runs
the same function on the same arguments, so the model's own collectives (an all-reduce
after a row-parallel layer) meet in step. A factory that returns a plain callable gets it
shared for it; one that builds its own scheduler wraps what must run on every rank with
`tp.shared(name, fn)`. Factories that take a `tp` parameter get the `TensorParallel` of
their process (size 1 and no group for an ordinary stage), so one factory serves both.

A rank that dies breaks the group: the collective or broadcast in flight on the others
fails at once (gloo: "connection closed by peer"). Rank 0 then fails the call with
UNAVAILABLE (`TensorParallelBroken`), the stage stops, and the launcher restarts every
rank of the group together (`omnirail.ops.launcher`). Arguments travel in omnirail's
payload format (msgpack header and tensor bytes), never pickle.
"""

from __future__ import annotations

import datetime
import logging
import os
import struct
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from omnirail.wire.errors import Code, OmniError
from omnirail.wire.payload import pack, unpack

log = logging.getLogger(__name__)

_STOP = "__stop__"
_PING = "__ping__"
_LEN = struct.Struct("<QQ")  # header bytes, data bytes


class TensorParallelBroken(OmniError):
    """A rank of the group is gone: the call cannot complete on every rank."""

    def __init__(self, stage: str, why: str) -> None:
        super().__init__(
            Code.UNAVAILABLE,
            f"tensor-parallel group of stage {stage!r} broke ({why}); it is being restarted",
            stage,
        )


class TensorParallel:
    """One process's place in its stage's tensor-parallel group."""

    def __init__(
        self,
        stage: str,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
        control: Any = None,
        device: str = "cpu",
    ) -> None:
        self.stage = stage
        self.rank = rank
        self.size = size
        # The group the model's collectives use (None when size is 1), and the gloo group
        # rank 0 broadcasts calls on (the model's may be NCCL, which carries no CPU bytes).
        self.group = group
        self._control = control
        self.device = device
        self._shared: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self.broken: str | None = None
        # Called once (from the thread that found it) when the group breaks.
        self.on_broken: Callable[[], None] | None = None

    # ---- joining -------------------------------------------------------------------

    @classmethod
    def join(
        cls,
        stage: str,
        rank: int,
        size: int,
        init_method: str,
        device: str = "cpu",
        timeout_s: float = 300.0,
    ) -> TensorParallel:
        """Joins the group at `init_method` (`tcp://HOST:PORT`, rank 0 hosts it); blocks
        until every rank has joined."""
        import torch.distributed as dist

        host = urlparse(init_method).hostname or ""
        if host in ("127.0.0.1", "localhost"):
            # gloo picks the interface of the hostname's address otherwise, which a
            # loopback rendezvous may not reach.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
        )
        group = dist.group.WORLD
        control = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        log.info("stage %s: tensor-parallel rank %d of %d joined (%s)", stage, rank, size, backend)
        return cls(stage, rank, size, group, control, device)

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    # ---- shared calls ----------------------------------------------------------------

    def shared(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` as every rank must run it. On rank 0: a callable that broadcasts its
        arguments, then runs `fn` here (followers run it on the same arguments). On a
        follower: `fn` is what `follow` runs for `name`. Arguments must be values omnirail
        payloads carry (tensors, numbers, strings, lists, dicts)."""
        if name in (_STOP, _PING) or name in self._shared:
            raise ValueError(f"shared call name {name!r} is reserved or already used")
        self._shared[name] = fn
        if self.size == 1 or self.rank != 0:
            return fn

        def lead(*args: Any) -> Any:
            with self._lock:  # one call in flight across the group at a time
                self._broadcast(name, list(args))
                try:
                    return fn(*args)
                except OmniError:
                    raise
                except Exception as exc:
                    # A dead rank fails the model's collectives; a model error leaves the
                    # group whole, and the followers answer a ping.
                    self._check_alive(exc)
                    raise

        return lead

    def _check_alive(self, exc: BaseException) -> None:
        try:
            self._broadcast(_PING, [])
        except TensorParallelBroken:
            raise TensorParallelBroken(self.stage, f"{type(exc).__name__}: {exc}") from exc

    def _broadcast(self, name: str, args: list[Any]) -> None:
        import torch
        import torch.distributed as dist

        if self.broken:
            raise TensorParallelBroken(self.stage, self.broken)
        packed = pack({"fn": name, "args": args})
        data = packed.to_bytes()
        frame = _LEN.pack(len(packed.header), len(data)) + packed.header + data
        try:
            size = torch.tensor([len(frame)], dtype=torch.int64)
            dist.broadcast(size, 0, group=self._control)
            dist.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0, self._control)
        except Exception as exc:
            self._break(f"{type(exc).__name__}: {str(exc)[:200]}")
            raise TensorParallelBroken(self.stage, self.broken or "") from exc

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            log.error("stage %s: tensor-parallel group broke: %s", self.stage, why)
            if self.on_broken is not None:
                try:
                    self.on_broken()
                except Exception:  # e.g. the stage's loop already closed at shutdown
                    log.exception("stage %s: reporting the broken group failed", self.stage)

    def stop_followers(self) -> None:
        """Rank 0: tells the followers to leave their loop (the stage stops)."""
        if self.size == 1 or self.rank != 0 or self.broken:
            return
        # A call still running holds the lock: then the launcher stops the followers.
        if not self._lock.acquire(timeout=0.5):
            return
        try:
            self._broadcast(_STOP, [])
        except TensorParallelBroken:
            pass
        finally:
            self._lock.release()

    # ---- followers -------------------------------------------------------------------

    def follow(self) -> None:
        """A follower's loop: runs each call rank 0 broadcasts, until it says stop.
        Raises TensorParallelBroken when rank 0 (or another rank) is gone."""
        import torch
        import torch.distributed as dist

        while True:
            try:
                size = torch.zeros(1, dtype=torch.int64)
                dist.broadcast(size, 0, group=self._control)
                frame = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.broadcast(frame, 0, group=self._control)
            except Exception as exc:
                raise TensorParallelBroken(self.stage, f"{type(exc).__name__}: {exc}") from exc
            raw = frame.numpy().tobytes()
            header_len, data_len = _LEN.unpack_from(raw)
            start = _LEN.size + header_len
            header, data = raw[_LEN.size : start], raw[start : start + data_len]
            call = unpack(header, data, copy=True)
            name = call["fn"]
            if name == _STOP:
                return
            if name == _PING:
                continue
            fn = self._shared.get(name)
            if fn is None:
                log.error("stage %s rank %d: no shared call %r", self.stage, self.rank, name)
                continue
            try:
                fn(*call["args"])
            except Exception:
                # Rank 0 runs the same call and reports its error to the client.
                log.exception(
                    "stage %s rank %d: shared call %r failed", self.stage, self.rank, name
                )
