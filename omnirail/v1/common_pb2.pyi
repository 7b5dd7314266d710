from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    INVALID_ARGUMENT: _ClassVar[ErrorCode]
    RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    CANCELLED: _ClassVar[ErrorCode]
    UNAVAILABLE: _ClassVar[ErrorCode]
    NOT_FOUND: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    FAILED_PRECONDITION: _ClassVar[ErrorCode]
    UNAUTHENTICATED: _ClassVar[ErrorCode]
    PERMISSION_DENIED: _ClassVar[ErrorCode]

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    PENDING: _ClassVar[RequestState]
    RUNNING: _ClassVar[RequestState]
    COMPLETED: _ClassVar[RequestState]
    FAILED: _ClassVar[RequestState]
    ABORTED: _ClassVar[RequestState]
ERROR_CODE_UNSPECIFIED: ErrorCode
INVALID_ARGUMENT: ErrorCode
RESOURCE_EXHAUSTED: ErrorCode
DEADLINE_EXCEEDED: ErrorCode
CANCELLED: ErrorCode
UNAVAILABLE: ErrorCode
NOT_FOUND: ErrorCode
INTERNAL: ErrorCode
FAILED_PRECONDITION: ErrorCode
UNAUTHENTICATED: ErrorCode
PERMISSION_DENIED: ErrorCode
REQUEST_STATE_UNSPECIFIED: RequestState
PENDING: RequestState
RUNNING: RequestState
COMPLETED: RequestState
FAILED: RequestState
ABORTED: RequestState

class Error(_message.Message):
    __slots__ = ("code", "message", "stage", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    stage: str
    retry_after_ms: int
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., stage: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class RelayDescriptor(_message.Message):
    __slots__ = ("backend", "region", "offset", "nbytes", "transfer_id", "extra")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    backend: str
    region: str
    offset: int
    nbytes: int
    transfer_id: int
    extra: bytes
    def __init__(self, backend: _Optional[str] = ..., region: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., transfer_id: _Optional[int] = ..., extra: _Optional[bytes] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("header", "inline_data", "relay")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    inline_data: bytes
    relay: RelayDescriptor
    def __init__(self, header: _Optional[bytes] = ..., inline_data: _Optional[bytes] = ..., relay: _Optional[_Union[RelayDescriptor, _Mapping]] = ...) -> None: ...
