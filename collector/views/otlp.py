"""`crosstrace export --otlp ENDPOINT`: the store's spans, on the aligned timeline, to any
OTLP/gRPC backend (an OpenTelemetry Collector, Jaeger, Tempo, ...).

Times are Unix-epoch ns: aligned reference time + the store's epoch_offset_ns. A span of a
node without a clock model cannot be placed and is left out (and counted), except on a
node whose clock already is the Unix epoch (clock=unix_epoch: spans that came in over
OTLP), whose times go out as they came. Each span carries its alignment error bound
(crosstrace.error_bound_ns) and its crosstrace kind where OpenTelemetry has none
(crosstrace.kind = compute, collective, ...). One ResourceSpans per node.
"""
import dataclasses

import grpc
import numpy as np
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from ...proto import semconv as sc
from ...proto.endpoint import target_of
from ...proto.semconv import Kind
from ..align import UNBOUNDED_NS
from ..columns import loads
from . import entries, placed_attributes

_OTEL_KIND = {kind: trace_pb2.Span.SpanKind.Value(f"SPAN_KIND_{name}") for name, kind in sc.OTEL_KINDS.items()}


@dataclasses.dataclass
class ExportResult:
    spans: int = 0           # sent and accepted
    rejected: int = 0        # the backend's partial_success count
    unplaced: int = 0        # left out: their node has no clock model
    oversize: int = 0        # left out: larger alone than a request may be
    requests: int = 0


_MAX_DEPTH = 16   # deeper values (a client's) travel as their text: protobuf decoders stop at ~100 messages deep


def any_value(value, depth: int = 0) -> "common_pb2.AnyValue":
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int) and -(1 << 63) <= value < 1 << 63:
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    if isinstance(value, (list, tuple)) and depth < _MAX_DEPTH:
        return common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=[any_value(v, depth + 1) for v in value]))
    if isinstance(value, dict) and depth < _MAX_DEPTH:
        return common_pb2.AnyValue(kvlist_value=common_pb2.KeyValueList(values=key_values(value, depth + 1)))
    return common_pb2.AnyValue(string_value=text(value))


def key_values(attributes: dict | None, depth: int = 0) -> list:
    return [common_pb2.KeyValue(key=text(k), value=any_value(v, depth)) for k, v in (attributes or {}).items()
            if v is not None]


def text(value) -> str:
    """str(value) as protobuf can send it: valid UTF-8 (a lone surrogate, which JSON lets a
    client send, becomes '?')."""
    value = str(value)
    return value if value.isascii() else value.encode("utf-8", "replace").decode("utf-8")


def resource(r) -> "resource_pb2.Resource":
    """An OTLP sender's resource as it sent it (types, and its own `clock` or `source`,
    which crosstrace's labels of the same names hid); a tracer's from its fields."""
    if r.attributes_json:
        try:
            attrs = loads(r.attributes_json)
        except ValueError:   # a store written before the collector checked it: the fields below
            attrs = None
        if isinstance(attrs, dict):
            attrs.setdefault(sc.NODE_ID, r.node_id)
            return resource_pb2.Resource(attributes=key_values(attrs))
    attrs = {"service.name": r.service_name or r.node_id, sc.NODE_ID: r.node_id}
    for key, value in (("host.name", r.host), ("process.pid", r.pid), (sc.ROLE, r.role), (sc.JOB_ID, r.job_id)):
        if value:
            attrs[key] = value
    if r.rank >= 0:
        attrs[sc.RANK] = r.rank
    for key, value in r.labels.items():
        attrs.setdefault(key, value)
    return resource_pb2.Resource(attributes=key_values(attrs))


def _epoch_times(analysed, node: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, placed) in Unix-epoch ns for a node's rows."""
    t, al = analysed.table, analysed.alignment
    if t.resources[node].labels.get(sc.CLOCK_LABEL) == sc.CLOCK_UNIX_EPOCH and (al.error[rows] >= UNBOUNDED_NS).all():
        return t.start[rows], t.end[rows], np.ones(len(rows), bool)
    placed = al.error[rows] < UNBOUNDED_NS
    return al.start[rows] + al.epoch_offset_ns, al.end[rows] + al.epoch_offset_ns, placed


def _event_mapper(analysed, node: int):
    """Local event time -> Unix-epoch ns, for the node's clock."""
    t, al = analysed.table, analysed.alignment
    node_id = t.nodes[node]
    model = al.models.get(node_id)
    if model is not None and model.known:
        return lambda local: int(al.to_reference(node_id, [local])[0]) + al.epoch_offset_ns
    return lambda local: int(local)


# OTLP/gRPC receivers take messages of 4 MiB by default (gRPC's limit, the OpenTelemetry
# Collector's and Jaeger's too): requests stay below, with room for the resource.
MAX_REQUEST_BYTES = 3 << 20


def requests(analysed, max_spans: int = 2000, result: ExportResult | None = None):
    """ExportTraceServiceRequests of at most `max_spans` spans and MAX_REQUEST_BYTES, node by
    node; a span larger than that alone is left out (and counted)."""
    t, al = analysed.table, analysed.alignment
    result = result if result is not None else ExportResult()
    for node in range(len(t.nodes)):
        node_rows = np.flatnonzero(t.node == node)
        if not len(node_rows):
            continue
        start, end, placed = _epoch_times(analysed, node, node_rows)
        result.unplaced += int((~placed).sum())
        event_time = _event_mapper(analysed, node)
        res = resource(t.resources[node])
        room = MAX_REQUEST_BYTES - res.ByteSize()
        spans, size = [], 0
        for i in np.flatnonzero(placed).tolist():
            span = _span(t, al, int(node_rows[i]), int(start[i]), int(end[i]), event_time)
            n = span.ByteSize() + 8   # and its field's tag and length
            if n > room:
                result.oversize += 1
                continue
            if len(spans) == max_spans or size + n > room:
                yield _request(res, spans)
                spans, size = [], 0
            spans.append(span)
            size += n
        if spans:
            yield _request(res, spans)


def _request(res, spans: list) -> "otlp.ExportTraceServiceRequest":
    return otlp.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=res, scope_spans=[trace_pb2.ScopeSpans(
            scope=common_pb2.InstrumentationScope(name="crosstrace"), spans=spans)])])


def _span(t, al, row: int, start: int, end: int, event_time) -> "trace_pb2.Span":
    kind = int(t.kind[row])
    attrs = dict(placed_attributes(t.attributes[row], lambda local: list(map(event_time, local))))
    if kind not in _OTEL_KIND and kind != Kind.INTERNAL:
        attrs[sc.KIND] = sc.KIND_NAMES.get(kind, str(kind))
    if al.error[row] < UNBOUNDED_NS:
        attrs[sc.ERROR_BOUND_NS] = int(al.error[row])
    extra = t.extras.get(row, {})
    span = trace_pb2.Span(
        trace_id=(int(t.trace_hi[row]) << 64 | int(t.trace_lo[row])).to_bytes(16, "big"),
        span_id=int(t.span_id[row]).to_bytes(8, "big"),
        parent_span_id=int(t.parent_id[row]).to_bytes(8, "big") if t.parent_id[row] else b"",
        name=text(t.names[t.name[row]]), kind=_OTEL_KIND.get(kind, trace_pb2.Span.SPAN_KIND_INTERNAL),
        start_time_unix_nano=max(start, 0), end_time_unix_nano=max(end, 0), attributes=key_values(attrs))
    status = int(t.status[row])
    if status:
        span.status.code = status          # crosstrace's 1 ok / 2 error are OTLP's codes
        if extra.get("status_message"):
            span.status.message = text(extra["status_message"])
    if extra.get("trace_state"):
        span.trace_state = text(extra["trace_state"])
    for name, when, event_attrs in entries(extra, "events", 3):
        span.events.add(name=text(name), time_unix_nano=max(event_time(when), 0),
                        attributes=key_values(event_attrs))
    for trace_hex, span_hex, link_attrs, *trace_state in entries(extra, "links", 3):
        span.links.add(trace_id=bytes.fromhex(trace_hex), span_id=bytes.fromhex(span_hex),
                       attributes=key_values(link_attrs), trace_state=text(trace_state[0]) if trace_state else "")
    return span


def channel(endpoint: str, ca: str | None = None) -> grpc.Channel:
    """`host:port` or `http://host:port`: plaintext; `https://host:port`, or any of them with
    `ca`: TLS (with `ca`, else the system's roots). Read as a tracer reads its endpoint."""
    target, tls = target_of(endpoint)
    if not (tls or ca):
        return grpc.insecure_channel(target)
    root = None
    if ca:
        with open(ca, "rb") as f:
            root = f.read()
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root))


def send(endpoint: str, analysed, headers: list[tuple[str, str]] = (), ca: str | None = None,
         timeout_s: float = 30.0, max_spans: int = 2000) -> ExportResult:
    """Export every placed span; raises grpc.RpcError (with the backend's status) on failure."""
    result = ExportResult()
    metadata = [(k.lower(), v) for k, v in headers]
    with channel(endpoint, ca) as ch:
        stub = otlp_grpc.TraceServiceStub(ch)
        for request in requests(analysed, max_spans, result):
            response = stub.Export(request, timeout=timeout_s, metadata=metadata, wait_for_ready=False)
            n = sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
            result.rejected += response.partial_success.rejected_spans
            result.spans += n - response.partial_success.rejected_spans
            result.requests += 1
    return result
