"""Log records carry the request and trace they belong to."""

from __future__ import annotations

import io
import logging
import threading

from omnirail.stage.scheduler import IncomingMessage, SimpleScheduler
from omnirail.telemetry.logs import FORMAT, ContextFilter, ids, request_context, trace_id_of

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _capture() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    logger = logging.getLogger(f"test-logs-{id(out)}")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, out


def test_records_inside_a_request_context_carry_its_ids() -> None:
    logger, out = _capture()
    logger.info("before")
    with request_context("r-1", TP):
        logger.info("inside")
    logger.info("after", extra=ids("r-2", None))
    logger.info("theirs", extra=ids("r-3", None, "team-a"))
    lines = out.getvalue().splitlines()
    assert "[request=- trace=- principal=-]: before" in lines[0]
    assert "[request=r-1 trace=0af7651916cd43dd8448eb211c80319c principal=-]: inside" in lines[1]
    assert "[request=r-2 trace=- principal=-]: after" in lines[2]
    assert "[request=r-3 trace=- principal=team-a]: theirs" in lines[3]


def test_trace_id_of_rejects_garbage() -> None:
    assert trace_id_of(TP) == "0af7651916cd43dd8448eb211c80319c"
    assert trace_id_of("") == trace_id_of(None) == trace_id_of("not-a-traceparent") == "-"


def test_simple_scheduler_tags_the_logs_of_stage_functions() -> None:
    logger, out = _capture()
    done = threading.Event()

    def fn(payload: object) -> object:
        logger.info("computing")
        done.set()
        return payload

    sched = SimpleScheduler(fn)
    sched.start()
    try:
        sched.inbox.put(IncomingMessage("r-9", "new_request", 1, traceparent=TP))
        assert done.wait(30)
    finally:
        sched.stop()
    line = "[request=r-9 trace=0af7651916cd43dd8448eb211c80319c principal=-]: computing"
    assert line in out.getvalue()
