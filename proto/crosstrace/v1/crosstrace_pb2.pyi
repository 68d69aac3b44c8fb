from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpanKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTERNAL: _ClassVar[SpanKind]
    COMPUTE: _ClassVar[SpanKind]
    COLLECTIVE: _ClassVar[SpanKind]
    SEND: _ClassVar[SpanKind]
    RECV: _ClassVar[SpanKind]
    RPC_CLIENT: _ClassVar[SpanKind]
    RPC_SERVER: _ClassVar[SpanKind]
    DATA: _ClassVar[SpanKind]

class ClockSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLOCK_SOURCE_UNSPECIFIED: _ClassVar[ClockSource]
    GRPC_EXCHANGE: _ClassVar[ClockSource]
    UDP_EXCHANGE: _ClassVar[ClockSource]
    RPC_PIGGYBACK: _ClassVar[ClockSource]
    NTP: _ClassVar[ClockSource]
    PTP: _ClassVar[ClockSource]
INTERNAL: SpanKind
COMPUTE: SpanKind
COLLECTIVE: SpanKind
SEND: SpanKind
RECV: SpanKind
RPC_CLIENT: SpanKind
RPC_SERVER: SpanKind
DATA: SpanKind
CLOCK_SOURCE_UNSPECIFIED: ClockSource
GRPC_EXCHANGE: ClockSource
UDP_EXCHANGE: ClockSource
RPC_PIGGYBACK: ClockSource
NTP: ClockSource
PTP: ClockSource

class Resource(_message.Message):
    __slots__ = ("node_id", "host", "rank", "world_size", "local_rank", "role", "job_id", "pid", "service_name", "labels", "attributes_json")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_JSON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    rank: int
    world_size: int
    local_rank: int
    role: str
    job_id: str
    pid: int
    service_name: str
    labels: _containers.ScalarMap[str, str]
    attributes_json: bytes
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_rank: _Optional[int] = ..., role: _Optional[str] = ..., job_id: _Optional[str] = ..., pid: _Optional[int] = ..., service_name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., attributes_json: _Optional[bytes] = ...) -> None: ...

class ClockSample(_message.Message):
    __slots__ = ("source", "peer", "t1", "t2", "t3", "t4", "local_ns", "offset_ns", "error_ns", "server", "peer_clock")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    T1_FIELD_NUMBER: _ClassVar[int]
    T2_FIELD_NUMBER: _ClassVar[int]
    T3_FIELD_NUMBER: _ClassVar[int]
    T4_FIELD_NUMBER: _ClassVar[int]
    LOCAL_NS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    ERROR_NS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    PEER_CLOCK_FIELD_NUMBER: _ClassVar[int]
    source: ClockSource
    peer: str
    t1: int
    t2: int
    t3: int
    t4: int
    local_ns: int
    offset_ns: int
    error_ns: int
    server: str
    peer_clock: str
    def __init__(self, source: _Optional[_Union[ClockSource, str]] = ..., peer: _Optional[str] = ..., t1: _Optional[int] = ..., t2: _Optional[int] = ..., t3: _Optional[int] = ..., t4: _Optional[int] = ..., local_ns: _Optional[int] = ..., offset_ns: _Optional[int] = ..., error_ns: _Optional[int] = ..., server: _Optional[str] = ..., peer_clock: _Optional[str] = ...) -> None: ...

class SpanBatch(_message.Message):
    __slots__ = ("resource", "session_id", "seq", "count", "trace_id_hi", "trace_id_lo", "span_id", "parent_span_id", "start_ns", "end_ns", "kind", "status", "name", "thread", "strings", "attributes_json", "extras_json", "clock_samples", "dropped_spans", "relayed_by")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_HI_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_LO_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_JSON_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_JSON_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SPANS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BY_FIELD_NUMBER: _ClassVar[int]
    resource: Resource
    session_id: bytes
    seq: int
    count: int
    trace_id_hi: bytes
    trace_id_lo: bytes
    span_id: bytes
    parent_span_id: bytes
    start_ns: bytes
    end_ns: bytes
    kind: bytes
    status: bytes
    name: bytes
    thread: bytes
    strings: _containers.RepeatedScalarFieldContainer[str]
    attributes_json: bytes
    extras_json: bytes
    clock_samples: _containers.RepeatedCompositeFieldContainer[ClockSample]
    dropped_spans: int
    relayed_by: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, resource: _Optional[_Union[Resource, _Mapping]] = ..., session_id: _Optional[bytes] = ..., seq: _Optional[int] = ..., count: _Optional[int] = ..., trace_id_hi: _Optional[bytes] = ..., trace_id_lo: _Optional[bytes] = ..., span_id: _Optional[bytes] = ..., parent_span_id: _Optional[bytes] = ..., start_ns: _Optional[bytes] = ..., end_ns: _Optional[bytes] = ..., kind: _Optional[bytes] = ..., status: _Optional[bytes] = ..., name: _Optional[bytes] = ..., thread: _Optional[bytes] = ..., strings: _Optional[_Iterable[str]] = ..., attributes_json: _Optional[bytes] = ..., extras_json: _Optional[bytes] = ..., clock_samples: _Optional[_Iterable[_Union[ClockSample, _Mapping]]] = ..., dropped_spans: _Optional[int] = ..., relayed_by: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExportAck(_message.Message):
    __slots__ = ("seq", "accepted", "duplicates", "rejected")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    accepted: int
    duplicates: int
    rejected: _containers.ScalarMap[str, int]
    def __init__(self, seq: _Optional[int] = ..., accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ClockProbe(_message.Message):
    __slots__ = ("node_id", "t1")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    T1_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    t1: int
    def __init__(self, node_id: _Optional[str] = ..., t1: _Optional[int] = ...) -> None: ...

class ClockProbeReply(_message.Message):
    __slots__ = ("t1", "t2", "t3", "clock")
    T1_FIELD_NUMBER: _ClassVar[int]
    T2_FIELD_NUMBER: _ClassVar[int]
    T3_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    t1: int
    t2: int
    t3: int
    clock: str
    def __init__(self, t1: _Optional[int] = ..., t2: _Optional[int] = ..., t3: _Optional[int] = ..., clock: _Optional[str] = ...) -> None: ...
