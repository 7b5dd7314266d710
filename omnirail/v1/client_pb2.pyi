from omnirail.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConversationRef(_message.Message):
    __slots__ = ("conversation_id",)
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    def __init__(self, conversation_id: _Optional[str] = ...) -> None: ...

class CloseConversationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "timeout_s", "traceparent", "stream", "input_stream", "conversation_id", "on_behalf_of")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    INPUT_STREAM_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    ON_BEHALF_OF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _common_pb2.Payload
    timeout_s: float
    traceparent: str
    stream: bool
    input_stream: bool
    conversation_id: str
    on_behalf_of: str
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Union[_common_pb2.Payload, _Mapping]] = ..., timeout_s: _Optional[float] = ..., traceparent: _Optional[str] = ..., stream: _Optional[bool] = ..., input_stream: _Optional[bool] = ..., conversation_id: _Optional[str] = ..., on_behalf_of: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RequestRef(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("request_id", "outputs")
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Payload
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Payload, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outputs: _containers.MessageMap[str, _common_pb2.Payload]
    def __init__(self, request_id: _Optional[str] = ..., outputs: _Optional[_Mapping[str, _common_pb2.Payload]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("stage", "chunk_id", "modality", "data")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    stage: str
    chunk_id: int
    modality: str
    data: _common_pb2.Payload
    def __init__(self, stage: _Optional[str] = ..., chunk_id: _Optional[int] = ..., modality: _Optional[str] = ..., data: _Optional[_Union[_common_pb2.Payload, _Mapping]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("chunk", "result")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    result: Result
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., result: _Optional[_Union[Result, _Mapping]] = ...) -> None: ...

class InputChunk(_message.Message):
    __slots__ = ("request_id", "chunk_id", "data", "done", "modality")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk_id: int
    data: _common_pb2.Payload
    done: bool
    modality: str
    def __init__(self, request_id: _Optional[str] = ..., chunk_id: _Optional[int] = ..., data: _Optional[_Union[_common_pb2.Payload, _Mapping]] = ..., done: _Optional[bool] = ..., modality: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "abort", "input")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    generate: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    abort: _containers.RepeatedCompositeFieldContainer[AbortRequest]
    input: _containers.RepeatedCompositeFieldContainer[InputChunk]
    def __init__(self, generate: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[_Union[AbortRequest, _Mapping]]] = ..., input: _Optional[_Iterable[_Union[InputChunk, _Mapping]]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("request_id", "result", "error", "chunk")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    result: Result
    error: _common_pb2.Error
    chunk: Chunk
    def __init__(self, request_id: _Optional[str] = ..., result: _Optional[_Union[Result, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "state", "result", "error", "elapsed_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: _common_pb2.RequestState
    result: Result
    error: _common_pb2.Error
    elapsed_s: float
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.RequestState, str]] = ..., result: _Optional[_Union[Result, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("request_id", "acknowledged_by", "not_acknowledged")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_BY_FIELD_NUMBER: _ClassVar[int]
    NOT_ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    acknowledged_by: _containers.RepeatedScalarFieldContainer[str]
    not_acknowledged: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., acknowledged_by: _Optional[_Iterable[str]] = ..., not_acknowledged: _Optional[_Iterable[str]] = ...) -> None: ...

class DescribePipelineRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("name", "next", "terminal", "wait_for", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    next: _containers.RepeatedScalarFieldContainer[str]
    terminal: bool
    wait_for: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, name: _Optional[str] = ..., next: _Optional[_Iterable[str]] = ..., terminal: _Optional[bool] = ..., wait_for: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("replica_id", "address", "live", "queue_depth", "inflight", "metrics_address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    live: bool
    queue_depth: int
    inflight: int
    metrics_address: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., live: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., inflight: _Optional[int] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class PipelineInfo(_message.Message):
    __slots__ = ("name", "entry_stage", "terminal_stages", "stages", "ready", "metrics_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRY_STAGE_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_STAGES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    entry_stage: str
    terminal_stages: _containers.RepeatedScalarFieldContainer[str]
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    ready: bool
    metrics_address: str
    def __init__(self, name: _Optional[str] = ..., entry_stage: _Optional[str] = ..., terminal_stages: _Optional[_Iterable[str]] = ..., stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ..., ready: _Optional[bool] = ..., metrics_address: _Optional[str] = ...) -> None: ...
