"""Typed errors shared by every service and the client SDK.

An `OmniError` carries an `ErrorCode` from the contract, a message, and the stage that
raised it. It converts to the wire `Error` message and to a gRPC status code.
"""

from __future__ import annotations

import grpc

from omnirail.v1 import common_pb2

Code = common_pb2.ErrorCode

_TO_GRPC: dict[int, grpc.StatusCode] = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Code.CANCELLED: grpc.StatusCode.CANCELLED,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}
_FROM_GRPC = {v: k for k, v in _TO_GRPC.items()}
# Trailing metadata key that names the stage an error came from on the client API.
STAGE_METADATA_KEY = "omnirail-stage"
# Trailing metadata carrying a refusal's retry hint in milliseconds (`retry_after_ms`).
RETRY_AFTER_KEY = "retry-after-ms"


class OmniError(Exception):
    """An error with a contract code; `stage` is empty when not raised by a stage.
    `retry_after_ms`: for RESOURCE_EXHAUSTED, when the caller may try again (0: no hint)."""

    retry_after_ms: int = 0

    def __init__(self, code: int, message: str, stage: str = "") -> None:
        super().__init__(message)
        self.code = int(code)
        self.message = message
        self.stage = stage

    @property
    def code_name(self) -> str:
        return Code.Name(self.code)

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return _TO_GRPC.get(self.code, grpc.StatusCode.UNKNOWN)

    def to_proto(self) -> common_pb2.Error:
        return common_pb2.Error(
            code=self.code,
            message=self.message,
            stage=self.stage,
            retry_after_ms=max(0, min(int(self.retry_after_ms), 0xFFFFFFFF)),
        )

    @classmethod
    def from_proto(cls, err: common_pb2.Error) -> OmniError:
        error = cls(err.code or Code.INTERNAL, err.message, err.stage)
        if err.retry_after_ms:
            error.retry_after_ms = err.retry_after_ms
        return error

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> OmniError:
        """The error a failed call carries: its status code mapped back, its details, and
        the stage named in its trailing metadata (the one place this mapping is done)."""
        code = _FROM_GRPC.get(err.code(), Code.INTERNAL)  # type: ignore[attr-defined]
        error = cls(code, err.details() or str(err.code()))  # type: ignore[attr-defined]
        trailing = getattr(err, "trailing_metadata", lambda: None)() or ()
        for key, value in trailing:
            if key == STAGE_METADATA_KEY:
                error.stage = value
            elif key == RETRY_AFTER_KEY and isinstance(value, str) and value.isdigit():
                error.retry_after_ms = min(int(value[:10]), 0xFFFFFFFF)
        return error

    def __str__(self) -> str:
        where = f" in stage {self.stage!r}" if self.stage else ""
        return f"{self.code_name}{where}: {self.message}"


class InputError(OmniError, ValueError):
    """A request's input is wrong in a way its caller can fix.

    Stage functions raise it for bad request fields; the client gets INVALID_ARGUMENT with
    this message (any other exception from a stage is INTERNAL, a bug of the stage). Name
    the field first: ``InputError("inputs.image_size: an integer within 8..1024, got 'abc'")``.
    It is a ValueError too, so validation code that catches ValueError keeps working.
    """

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__(Code.INVALID_ARGUMENT, message, stage)


def invalid(message: str, stage: str = "") -> OmniError:
    return OmniError(Code.INVALID_ARGUMENT, message, stage)


def unavailable(message: str, stage: str = "") -> OmniError:
    return OmniError(Code.UNAVAILABLE, message, stage)


def internal(message: str, stage: str = "") -> OmniError:
    return OmniError(Code.INTERNAL, message, stage)
