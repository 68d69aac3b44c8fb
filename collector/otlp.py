"""OpenTelemetry's OTLP/gRPC TraceService/Export, served on the collector's own port, so
that services instrumented with any OpenTelemetry SDK, in any language, report here.

Each ResourceSpans of a request becomes one columnar SpanBatch, which goes through the
same checks (ingest.check) and the same store as crosstrace's own batches: a span with an
invalid id, an end before its start, ... is rejected on its own and counted, and the
request is answered with OTLP's partial_success.

Clock: OTLP times are Unix-epoch ns from the sender's wall clock, not a monotonic clock.
They are stored as they are, and the node's Resource says so with the label
`clock=unix_epoch` (proto.semconv.CLOCK_LABEL / CLOCK_UNIX_EPOCH): its clock model is the
collector's reference + epoch offset, as accurate as the sender's NTP.

Node id (one clock domain): the resource attribute `crosstrace.node_id`, else
"<host.name>/<process.pid>" (as crosstrace names its own processes), else
`service.instance.id`, else "otlp/<service.name>".
"""
import collections

import grpc
import numpy as np
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.trace.v1 import trace_pb2

from ..proto import pb
from ..proto import semconv as sc
from ..proto.attributes_json import dumps
from ..proto.semconv import Kind
from .columns import BadBatch
from .ingest import MAX_SPANS_PER_BATCH, StoreUnavailable, TooLarge

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"

_KINDS = {trace_pb2.Span.SpanKind.Value(f"SPAN_KIND_{name}"): kind for name, kind in sc.OTEL_KINDS.items()}
_I64_MAX = (1 << 63) - 1
_MAX_LABEL = 256


def value_of(v):
    """An OTLP AnyValue as plain JSON-able Python (bytes as hex, as the tracer sends them)."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [value_of(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


def attributes_of(key_values) -> dict:
    return {kv.key: value_of(kv.value) for kv in key_values}


def _int(value, limit: int, default: int) -> int:
    """An attribute that must be an integer in [0, limit): a bool is not one (isinstance
    says it is, and a Resource field refused it, failing the whole request)."""
    return value if type(value) is int and 0 <= value < limit else default


def resource_of(resource) -> "pb.Resource":
    attrs = attributes_of(resource.attributes)
    host = str(attrs.get("host.name", ""))
    pid = _int(attrs.get("process.pid"), 1 << 31, 0)
    service = str(attrs.get("service.name", ""))
    node = (attrs.get(sc.NODE_ID) or (f"{host}/{pid}" if host and pid else "")
            or attrs.get("service.instance.id") or f"otlp/{service or 'unknown'}")
    rank = attrs.get(sc.RANK)
    labels = {k: str(v) for k, v in attrs.items() if len(str(v)) <= _MAX_LABEL}
    labels.update({sc.CLOCK_LABEL: sc.CLOCK_UNIX_EPOCH, sc.SOURCE_LABEL: "otlp"})
    rank = _int(rank, 1 << 31, -1)
    return pb.Resource(node_id=str(node), host=host, rank=rank,
                       world_size=0, local_rank=-1, role=str(attrs.get(sc.ROLE, "")),
                       job_id=str(attrs.get(sc.JOB_ID, "")), pid=pid, service_name=service, labels=labels,
                       attributes_json=dumps(attrs))


def _u64(raw: bytes, size: int) -> int:
    """A W3C id as an integer; 0 (which the checks reject) when its length is wrong."""
    return int.from_bytes(raw, "big") if len(raw) == size else 0


def _time(t: int) -> int:
    return t if t <= _I64_MAX else _I64_MAX   # the checks reject it as absurd


def to_batch(resource_spans) -> tuple["pb.SpanBatch", collections.Counter]:
    """One ResourceSpans as a SpanBatch (no session: OTLP has no resend numbering; stored
    spans are still deduplicated by (trace_id, span_id)), and the spans left out by reason:
    a parent id of the wrong length (it was read as none, the span stored as a root)."""
    spans = [span for scope in resource_spans.scope_spans for span in scope.spans]
    rejected = collections.Counter()
    if any(s.parent_span_id and len(s.parent_span_id) != 8 for s in spans):
        kept = [s for s in spans if not s.parent_span_id or len(s.parent_span_id) == 8]
        rejected["invalid_parent_span_id"] = len(spans) - len(kept)
        spans = kept
    n = len(spans)
    cols = collections.defaultdict(list)
    strings: dict[str, int] = {}
    attributes, extras = [], []
    for i, s in enumerate(spans):
        trace = _u64(s.trace_id, 16)
        cols["trace_id_hi"].append(trace >> 64)
        cols["trace_id_lo"].append(trace & ((1 << 64) - 1))
        cols["span_id"].append(_u64(s.span_id, 8))
        cols["parent_span_id"].append(_u64(s.parent_span_id, 8))
        cols["start_ns"].append(_time(s.start_time_unix_nano))
        cols["end_ns"].append(_time(s.end_time_unix_nano))
        attrs = attributes_of(s.attributes)
        kind = _KINDS.get(s.kind, Kind.INTERNAL)
        if sc.KIND in attrs:
            kind = sc.KIND_BY_NAME.get(str(attrs.pop(sc.KIND)).lower(), kind)
        cols["kind"].append(int(kind))
        code = int(s.status.code)
        cols["status"].append(code if 0 <= code <= 255 else 255)   # out of range: rejected as unknown_status
        cols["name"].append(strings.setdefault(s.name, len(strings)))
        cols["thread"].append(_int(attrs.get("thread.id"), 1 << 64, 0))
        attributes.append(attrs or None)
        extra = {}
        if s.events:
            extra["events"] = [[e.name, _time(e.time_unix_nano), attributes_of(e.attributes) or None]
                               for e in s.events]
        if s.links:
            extra["links"] = [[l.trace_id.hex(), l.span_id.hex(), attributes_of(l.attributes) or None]
                              + ([l.trace_state] if l.trace_state else []) for l in s.links]
        if s.status.message:
            extra["status_message"] = s.status.message
        if s.trace_state:
            extra["trace_state"] = s.trace_state
        if extra:
            extras.append([i, extra])
    batch = pb.SpanBatch(resource=resource_of(resource_spans.resource), count=n)
    for field, dtype in (("trace_id_hi", "<u8"), ("trace_id_lo", "<u8"), ("span_id", "<u8"),
                         ("parent_span_id", "<u8"), ("start_ns", "<i8"), ("end_ns", "<i8"), ("kind", "u1"),
                         ("status", "u1"), ("name", "<u4"), ("thread", "<u8")):
        setattr(batch, field, np.array(cols[field], dtype=dtype).tobytes())
    batch.strings.extend(strings)
    batch.attributes_json = dumps(attributes)
    if extras:
        batch.extras_json = dumps(extras)
    return batch, rejected


class OtlpService:
    """TraceService/Export onto a collector's ingest path (a server.CollectorService): the
    same checks, store, bound on bytes in flight and counts of whole batches refused."""

    def __init__(self, service):
        self.service = service

    def export(self, data: bytes, context):
        try:
            request = otlp.ExportTraceServiceRequest.FromString(data)
        except Exception as exc:
            self.service.refuse(BadBatch(f"undecodable ExportTraceServiceRequest: {exc}"), context)
        rejected: collections.Counter = collections.Counter()
        try:
            with self.service.in_flight.hold(len(data)):
                batches = []   # every resource read before any is stored: a request fails whole or not at all
                for resource_spans in request.resource_spans:
                    n = sum(len(scope.spans) for scope in resource_spans.scope_spans)
                    if n > MAX_SPANS_PER_BATCH:   # refused before the spans are converted one by one
                        raise TooLarge(f"a resource holds {n} spans; at most {MAX_SPANS_PER_BATCH} per request")
                    try:
                        batch, left_out = to_batch(resource_spans)
                    except Exception as exc:   # a value nothing reads
                        raise BadBatch(f"unreadable ResourceSpans: {exc!r}") from None
                    if batch.count:
                        batches.append(batch)
                    rejected.update(left_out)
                left_out = collections.Counter(rejected)
                for batch in batches:
                    checked, _ = self.service.ingest(batch)
                    rejected.update(checked.rejected)
                if left_out:   # counted once the request is kept: a retried one was counted again
                    self.service.count_rejects(left_out)
        except BadBatch as exc:
            self.service.refuse(exc, context)
        except StoreUnavailable as exc:   # not kept: the sender retries
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:   # spans this collector cannot read: a retry would fail alike
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unreadable spans: {exc!r}")
        response = otlp.ExportTraceServiceResponse()
        if rejected:
            response.partial_success.rejected_spans = sum(rejected.values())
            response.partial_success.error_message = "rejected spans: " + ", ".join(
                f"{n} {reason}" for reason, n in sorted(rejected.items()))
        return response.SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(self.export, request_deserializer=None,
                                                          response_serializer=None)})
