"""Tests for omnirail.telemetry.tracer: W3C traceparent and sampling decisions."""

from __future__ import annotations

import pytest

from omnirail.telemetry.tracer import (
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_ERROR,
    Span,
    SpanContext,
    Tracer,
    attributes_of,
    parse_traceparent,
    sdk_root_sampler,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_traceparent_round_trip() -> None:
    for sampled in (True, False):
        ctx = SpanContext(int(TRACE, 16), int(SPAN, 16), sampled)
        text = ctx.traceparent
        assert text == f"00-{TRACE}-{SPAN}-{'01' if sampled else '00'}"
        back = parse_traceparent(text)
        assert back is not None
        assert (back.trace_id, back.span_id, back.sampled) == (ctx.trace_id, ctx.span_id, sampled)


def test_traceparent_small_ids_are_zero_padded() -> None:
    ctx = SpanContext(1, 2, True)
    assert ctx.traceparent == f"00-{1:032x}-{2:016x}-01"
    back = parse_traceparent(ctx.traceparent)
    assert back is not None and (back.trace_id, back.span_id) == (1, 2)


def test_traceparent_uppercase_and_whitespace_accepted() -> None:
    ctx = parse_traceparent(f"  00-{TRACE.upper()}-{SPAN.upper()}-01 ")
    assert ctx is not None
    assert ctx.trace_id == int(TRACE, 16) and ctx.span_id == int(SPAN, 16) and ctx.sampled


def test_traceparent_sampled_is_bit_zero_of_flags() -> None:
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-03").sampled  # type: ignore[union-attr]
    assert not parse_traceparent(f"00-{TRACE}-{SPAN}-02").sampled  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        f"ff-{TRACE}-{SPAN}-01",  # version ff is forbidden
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero span id
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
        f"00-{TRACE}0-{SPAN}-01",  # long trace id
        f"00-{TRACE}-{SPAN[:-1]}-01",  # short span id
        f"00-{TRACE}-{SPAN}0-01",  # long span id
        f"0-{TRACE}-{SPAN}-01",  # short version
        f"00-{TRACE}-{SPAN}-1",  # short flags
        f"00-{TRACE}-{SPAN}-01-extra",
        f"00-{TRACE[:-1]}g-{SPAN}-01",  # not hex
        f"00_{TRACE}_{SPAN}_01",
    ],
)
def test_traceparent_rejects(value: str | None) -> None:
    assert parse_traceparent(value) is None


def recording() -> tuple[Tracer, list[Span]]:
    ended: list[Span] = []
    return Tracer(ended.append), ended


def test_new_trace_without_parent() -> None:
    tracer, ended = recording()
    span = tracer.start("root", None, {"a": 1}, kind=KIND_SERVER)
    assert span is not None
    assert span.parent_span_id == 0 and span.kind == KIND_SERVER
    assert span.context.trace_id and span.context.span_id and span.context.sampled
    assert ended == []
    span.end()
    span.end()  # a second end neither re-queues nor moves the end time
    assert ended == [span] and span.end_ns >= span.start_ns


def test_child_follows_sampled_parent() -> None:
    tracer, _ = recording()
    parent = SpanContext(int(TRACE, 16), int(SPAN, 16), True)
    span = tracer.start("child", parent)
    assert span is not None
    assert span.context.trace_id == parent.trace_id
    assert span.parent_span_id == parent.span_id
    assert span.context.span_id != parent.span_id
    grandchild = tracer.start("grandchild", span)
    assert grandchild is not None
    assert grandchild.parent_span_id == span.context.span_id
    assert grandchild.context.trace_id == parent.trace_id


def test_child_of_unsampled_parent_is_not_recorded() -> None:
    tracer, _ = recording()
    parent = SpanContext(int(TRACE, 16), int(SPAN, 16), False)
    assert tracer.start("child", parent) is None


def test_root_sampler_decides_at_the_mesh_entry() -> None:
    seen: list[tuple[SpanContext | None, int, str]] = []

    def sampler(ctx: SpanContext | None, trace_id: int, name: str) -> bool:
        seen.append((ctx, trace_id, name))
        return name == "keep"

    tracer = Tracer(lambda s: None, root_sampler=sampler)
    parent = SpanContext(int(TRACE, 16), int(SPAN, 16), True)
    assert tracer.start("drop", parent, root=True) is None
    kept = tracer.start("keep", parent, root=True)
    assert kept is not None and kept.context.trace_id == parent.trace_id
    assert seen[0] == (parent, parent.trace_id, "drop")
    # Without `root` the parent's flag decides and the sampler is not asked.
    assert tracer.start("drop", parent) is not None
    assert len(seen) == 2


def test_sdk_root_sampler_follows_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    sampled = SpanContext(int(TRACE, 16), int(SPAN, 16), True)
    unsampled = SpanContext(int(TRACE, 16), int(SPAN, 16), False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    tracer = Tracer(lambda s: None, root_sampler=sdk_root_sampler())
    # The default sampler is parentbased_always_on.
    assert tracer.start("r", None, root=True) is not None
    assert tracer.start("r", sampled, root=True) is not None
    assert tracer.start("r", unsampled, root=True) is None
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracer = Tracer(lambda s: None, root_sampler=sdk_root_sampler())
    assert tracer.start("r", None, root=True) is None
    assert tracer.start("r", sampled, root=True) is None


def test_disabled_tracer_returns_none() -> None:
    tracer = Tracer(None)
    assert not tracer.enabled
    assert tracer.start("x", None) is None
    assert tracer.record("x", None, 1, 2) == 0


def test_record_makes_a_finished_child_that_rides_with_its_parent() -> None:
    tracer, ended = recording()
    parent = tracer.start("parent", None)
    assert parent is not None
    span_id = tracer.record("queue", parent, 100, 50, {"n": 1})
    assert span_id and ended == []  # not exported on its own
    # Never ends before it starts (clocks step).
    assert parent.children == [("queue", span_id, 100, 100, {"n": 1})]
    parent.end()
    assert ended == [parent]


def test_record_after_parent_ended_goes_alone() -> None:
    tracer, ended = recording()
    parent = tracer.start("parent", None)
    assert parent is not None
    parent.end()
    span_id = tracer.record("late", parent, 1, 2)
    [late] = ended[1:]
    assert late.name == "late" and late.context.span_id == span_id
    assert late.kind == KIND_INTERNAL
    assert late.parent_span_id == parent.context.span_id
    assert late.context.trace_id == parent.context.trace_id


def test_span_helpers() -> None:
    tracer, _ = recording()
    span = tracer.start("s", None)
    assert span is not None
    span.set("k", "v")
    span.event("e", {"x": 1})
    span.link(SpanContext(1, 2, True))
    span.link(None)
    span.error("boom")
    assert span.attributes == {"k": "v"}
    assert span.events[0][0] == "e" and span.events[0][2] == {"x": 1}
    assert len(span.links) == 1
    assert (span.status_code, span.status_message) == (STATUS_ERROR, "boom")
    assert span.traceparent == span.context.traceparent


def test_attributes_of_keeps_scalars() -> None:
    assert attributes_of({"a": "s", "b": True, "c": 1, "d": 1.5, "e": [1], "f": None}) == {
        "a": "s",
        "b": True,
        "c": 1,
        "d": 1.5,
        "e": "[1]",
        "f": "None",
    }
