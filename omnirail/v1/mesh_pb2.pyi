from omnirail.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Register(_message.Message):
    __slots__ = ("stage", "replica_id", "address", "pid", "relay_backends", "metrics_address", "relay_infos")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RELAY_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_INFOS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    replica_id: str
    address: str
    pid: int
    relay_backends: _containers.RepeatedScalarFieldContainer[str]
    metrics_address: str
    relay_infos: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, stage: _Optional[str] = ..., replica_id: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., relay_backends: _Optional[_Iterable[str]] = ..., metrics_address: _Optional[str] = ..., relay_infos: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "output", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output: _common_pb2.Payload
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., output: _Optional[_Union[_common_pb2.Payload, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("request_id", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error: _common_pb2.Error
    def __init__(self, request_id: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("queue_depth", "inflight")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    inflight: int
    def __init__(self, queue_depth: _Optional[int] = ..., inflight: _Optional[int] = ...) -> None: ...

class AbortAck(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ClientChunk(_message.Message):
    __slots__ = ("request_id", "chunk_id", "modality", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk_id: int
    modality: str
    data: _common_pb2.Payload
    def __init__(self, request_id: _Optional[str] = ..., chunk_id: _Optional[int] = ..., modality: _Optional[str] = ..., data: _Optional[_Union[_common_pb2.Payload, _Mapping]] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("register", "completions", "failures", "abort_acks", "load", "chunks", "draining")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    ABORT_ACKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    register: Register
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    abort_acks: _containers.RepeatedCompositeFieldContainer[AbortAck]
    load: Load
    chunks: _containers.RepeatedCompositeFieldContainer[ClientChunk]
    draining: bool
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ..., abort_acks: _Optional[_Iterable[_Union[AbortAck, _Mapping]]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[ClientChunk, _Mapping]]] = ..., draining: _Optional[bool] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("replica_id", "address", "relay_infos", "member_digest")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_INFOS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    relay_infos: _containers.RepeatedScalarFieldContainer[bytes]
    member_digest: bytes
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., relay_infos: _Optional[_Iterable[bytes]] = ..., member_digest: _Optional[bytes] = ...) -> None: ...

class StageEndpoints(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("stages", "coordinator_digest", "draining")
    class StagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: StageEndpoints
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[StageEndpoints, _Mapping]] = ...) -> None: ...
    class DrainingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: StageEndpoints
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[StageEndpoints, _Mapping]] = ...) -> None: ...
    STAGES_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.MessageMap[str, StageEndpoints]
    coordinator_digest: bytes
    draining: _containers.MessageMap[str, StageEndpoints]
    def __init__(self, stages: _Optional[_Mapping[str, StageEndpoints]] = ..., coordinator_digest: _Optional[bytes] = ..., draining: _Optional[_Mapping[str, StageEndpoints]] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CoordinatorCommand(_message.Message):
    __slots__ = ("topology", "aborts", "shutdown", "released", "closed_conversations", "member_token")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    topology: Topology
    aborts: _containers.RepeatedCompositeFieldContainer[Abort]
    shutdown: Shutdown
    released: bool
    closed_conversations: _containers.RepeatedScalarFieldContainer[str]
    member_token: bytes
    def __init__(self, topology: _Optional[_Union[Topology, _Mapping]] = ..., aborts: _Optional[_Iterable[_Union[Abort, _Mapping]]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., released: _Optional[bool] = ..., closed_conversations: _Optional[_Iterable[str]] = ..., member_token: _Optional[bytes] = ...) -> None: ...

class RequestMeta(_message.Message):
    __slots__ = ("terminal_stages", "deadline", "conversation_id")
    TERMINAL_STAGES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    terminal_stages: _containers.RepeatedScalarFieldContainer[str]
    deadline: float
    conversation_id: str
    def __init__(self, terminal_stages: _Optional[_Iterable[str]] = ..., deadline: _Optional[float] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class StreamSignal(_message.Message):
    __slots__ = ("chunk_id", "done", "error", "modality")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    done: bool
    error: _common_pb2.Error
    modality: str
    def __init__(self, chunk_id: _Optional[int] = ..., done: _Optional[bool] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., modality: _Optional[str] = ...) -> None: ...

class DeliverItem(_message.Message):
    __slots__ = ("seq", "request_id", "from_stage", "to_stage", "payload", "traceparent", "meta", "stream")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    TO_STAGE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    seq: int
    request_id: str
    from_stage: str
    to_stage: str
    payload: _common_pb2.Payload
    traceparent: str
    meta: RequestMeta
    stream: StreamSignal
    def __init__(self, seq: _Optional[int] = ..., request_id: _Optional[str] = ..., from_stage: _Optional[str] = ..., to_stage: _Optional[str] = ..., payload: _Optional[_Union[_common_pb2.Payload, _Mapping]] = ..., traceparent: _Optional[str] = ..., meta: _Optional[_Union[RequestMeta, _Mapping]] = ..., stream: _Optional[_Union[StreamSignal, _Mapping]] = ...) -> None: ...

class DeliverBatch(_message.Message):
    __slots__ = ("sender", "items")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    sender: str
    items: _containers.RepeatedCompositeFieldContainer[DeliverItem]
    def __init__(self, sender: _Optional[str] = ..., items: _Optional[_Iterable[_Union[DeliverItem, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    error: _common_pb2.Error
    def __init__(self, seq: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class AckBatch(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    def __init__(self, acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ...) -> None: ...
