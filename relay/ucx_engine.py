"""The UCX worker of a `ucx` relay, progressed from the owning asyncio loop (see
omnirail/relay/ucx.py): it waits on the worker's epoll fd (or spins while transfers are in
flight, option `progress: polling`), runs each request's completion callback, and a
watchdog progresses anyway while anything is in flight."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

# ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: it would warn in every process.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx_api  # ImportError here: the backend is unavailable
from ucxx._lib.arr import Array
from ucxx.types import Tag

from omnirail.relay.base import RelayError

log = logging.getLogger("omnirail.relay.ucx")

WATCHDOG_S = 0.05  # progress anyway this often while transfers are in flight
CLOSE_S = 0.1  # bound of a synchronous close

Callback = Callable[[BaseException | None], None]


class Engine:
    """One UCX worker progressed from an asyncio loop; completions run callbacks."""

    def __init__(self, config: dict[str, str], polling: bool) -> None:
        feats = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        self.context: Any = ucx_api.UCXContext(config, feature_flags=feats)
        self.worker: Any = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.fd = self.worker.epoll_file_descriptor
        self.polling = polling
        self.loop: asyncio.AbstractEventLoop | None = None
        # request -> (callback, what its buffer lives in, counts as in flight)
        self.pending: dict[Any, tuple[Callback | None, Any, bool]] = {}
        self.active = 0
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None

    def attach(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on a loop: attached by the first call from one
        if loop is not self.loop and self.worker is not None:  # (None: closed)
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_reader(self.fd)
            self.loop = loop
            loop.add_reader(self.fd, self.progress)
            self.kick()

    def track(self, req: Any, cb: Callback | None, keep: Any, active: bool = True) -> None:
        self.pending[req] = (cb, keep, active)
        self.active += active
        self.kick()

    def forget(self, req: Any) -> None:
        """Stops tracking `req`; when its last reference goes, ucxx cancels it."""
        entry = self.pending.pop(req, None)
        self.active -= bool(entry and entry[2])

    def first(self, *reqs: tuple[Any, Any]) -> asyncio.Future[int]:
        """Index of the first of (request, buffer) `reqs` to complete, or its error."""
        assert self.loop is not None
        fut = self.loop.create_future()

        def done(i: int, err: BaseException | None) -> None:
            if fut.done():
                pass
            elif err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(i)

        for i, (req, keep) in enumerate(reqs):
            self.track(req, functools.partial(done, i), keep)
        return fut

    def send(self, ep: Any, data: bytes, tag: int) -> None:
        req = ep.tag_send(Array(data), Tag(tag))
        self.track(req, None, data)

    def kick(self) -> None:
        # Posting may leave work for progress, and the worker must be re-armed after it.
        if not self._scheduled and self.loop is not None:
            self._scheduled = True
            self.loop.call_soon(self.progress)

    def progress(self) -> None:
        self._scheduled = False
        worker = self.worker
        if worker is None:
            return  # closed after this was scheduled
        while True:
            worker.progress()
            if self._complete():
                continue  # callbacks may have posted more
            if self.polling and self.active:
                self.kick()  # unarmed meanwhile: peers need not wake us
                return
            if worker.arm():
                break
        if self.active and self._timer is None and self.loop is not None:
            self._timer = self.loop.call_later(WATCHDOG_S, self._watchdog)

    def _complete(self) -> int:
        done = [req for req in self.pending if req.completed]
        for req in done:
            cb, _, active = self.pending.pop(req)
            self.active -= active
            if cb is None:
                continue
            try:
                req.check_error()
                err = None
            except Exception as e:
                err = e
            try:
                cb(err)
            except Exception:
                log.exception("ucx relay: completion callback failed")
        return len(done)

    def _watchdog(self) -> None:
        self._timer = None
        self.progress()

    def drain(self) -> None:
        """Progresses while anything is in flight, for a while: a send still waiting for
        its receiver when the endpoint closes would keep the worker (and fds) for good."""
        deadline = time.monotonic() + CLOSE_S
        while self.active and self.worker is not None and time.monotonic() < deadline:
            self.worker.progress()
            self._complete()

    def close(self, why: str) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
        if self._timer is not None:
            self._timer.cancel()
        pending, self.pending, self.active, self.loop = self.pending, {}, 0, None
        for cb, _, _ in pending.values():
            if cb is not None:
                with contextlib.suppress(Exception):  # e.g. a waiter whose loop is gone
                    cb(RelayError(why))
        self.worker = self.context = None
