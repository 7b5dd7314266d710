"""What the coordinator checks before a request or a stage gets in: a client's inputs and
timeout, the terminal stages a request waits for, and a stage's Register. Pure checks;
each raises (or returns) an OmniError that says precisely what is wrong."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from omnirail.v1 import client_pb2, mesh_pb2
from omnirail.wire.errors import Code, OmniError, internal, invalid
from omnirail.wire.payload import PayloadError, decode_inline

REQUEST_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")  # whole string: fullmatch
# Relay infos ride in every topology broadcast: bounded so one bad stage cannot bloat them.
MAX_RELAY_INFOS = 8
MAX_RELAY_INFO_BYTES = 1 << 20


def check_request_id(rid: str) -> None:
    if not REQUEST_ID.fullmatch(rid):
        raise invalid("request_id must be 1-128 characters of [A-Za-z0-9._:@-]")


def check_conversation_id(conversation_id: str) -> None:
    if not REQUEST_ID.fullmatch(conversation_id):
        raise invalid("conversation_id must be 1-128 characters of [A-Za-z0-9._:@-]")


def parse_inputs(request: client_pb2.GenerateRequest, max_bytes: int) -> dict[str, Any]:
    """The request's inputs as a mapping of names to values (views over its bytes)."""
    if not request.HasField("inputs"):
        raise invalid("inputs: required")
    size = request.inputs.ByteSize()
    if size > max_bytes:
        raise OmniError(
            Code.RESOURCE_EXHAUSTED,
            f"inputs: {size} bytes exceed the pipeline's limit of {max_bytes} bytes (max_input_mb)",
        )
    if request.inputs.HasField("relay"):
        raise invalid("inputs: relay descriptors are not accepted from clients; send inline")
    try:
        # numpy only: a client's "torch" placeholder must not make the coordinator import
        # torch (seconds of its event loop, once); hooks here see numpy arrays.
        inputs = decode_inline(request.inputs, copy=False, numpy_only=True)
    except PayloadError as exc:
        raise invalid(f"inputs: {exc}") from None
    if not isinstance(inputs, dict) or not all(isinstance(k, str) for k in inputs):
        raise invalid(f"inputs: expected a mapping of names to values, got {type(inputs).__name__}")
    return inputs


def timeout_of(
    request: client_pb2.GenerateRequest, default_s: float, time_remaining: float | None
) -> float:
    """The request's own timeout, else the pipeline's default; never past the call's."""
    timeout = request.timeout_s or default_s
    if not math.isfinite(timeout) or timeout < 0:
        raise invalid(f"timeout_s: must be a finite number >= 0, got {request.timeout_s}")
    return timeout if time_remaining is None else min(timeout, time_remaining)


def resolve_terminals(
    fn: Callable[[str, dict[str, Any]], Any] | None,
    terminals: tuple[str, ...],
    rid: str,
    inputs: dict[str, Any],
) -> tuple[str, ...]:
    """The terminal stages this request waits for: what `terminal_stages_fn` picks among
    `terminals` (all of them without a hook, or when it returns None)."""
    if fn is None:
        return terminals
    try:
        chosen = fn(rid, inputs)
    except Exception as exc:
        raise internal(f"terminal_stages_fn raised {type(exc).__name__}: {exc}") from None
    if chosen is None:
        return terminals
    names = [chosen] if isinstance(chosen, str) else list(chosen)
    bad = [n for n in names if n not in terminals]
    if not names or bad:
        raise internal(
            f"terminal_stages_fn returned {names!r}; expected a non-empty subset of "
            f"the terminal stages {list(terminals)}"
        )
    return tuple(n for n in terminals if n in names)


def register_error(first: mesh_pb2.StageEvent | None, stages: list[str]) -> OmniError | None:
    """What is wrong with an Attach stream's first message (None: a valid Register)."""
    if first is None or not first.HasField("register"):
        return invalid("the first Attach message must be a Register")
    reg = first.register
    if reg.stage not in stages:
        return invalid(f"unknown stage {reg.stage!r}; this pipeline has {stages}")
    if not reg.address or not reg.replica_id:
        return invalid("register: address and replica_id are required")
    if len(reg.relay_infos) > MAX_RELAY_INFOS or any(
        len(info) > MAX_RELAY_INFO_BYTES for info in reg.relay_infos
    ):
        return invalid(
            f"register: at most {MAX_RELAY_INFOS} relay infos of at most "
            f"{MAX_RELAY_INFO_BYTES} bytes each"
        )
    return None
