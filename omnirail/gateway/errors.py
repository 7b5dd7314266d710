"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status its clients map to exceptions (400 BadRequestError, 401, 404, 429, 5xx)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from omnirail.wire.errors import Code, OmniError


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # A 429's `Retry-After` (whole seconds, as HTTP has it).
        self.retry_after_s = retry_after_s

    @property
    def kind(self) -> str:
        default = "server_error" if self.status >= 500 else "invalid_request_error"
        return _TYPES.get(self.status, default)

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": {**error, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"retry-after": str(self.retry_after_s)} if self.retry_after_s else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
# Mesh error codes -> HTTP status (what an OpenAI client raises for them).
_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.FAILED_PRECONDITION: 400,
    Code.NOT_FOUND: 404,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
    Code.CANCELLED: 499,
    Code.INTERNAL: 500,
}


def from_mesh(error: OmniError) -> ApiError:
    where = f" (stage {error.stage})" if error.stage else ""
    retry = -(-error.retry_after_ms // 1000) if error.retry_after_ms else None
    return ApiError(
        _STATUS.get(error.code, 500),
        f"{error.message}{where}",
        code=error.code_name.lower(),
        retry_after_s=retry,
    )


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)
