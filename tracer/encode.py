"""Spans -> one columnar SpanBatch, on the exporter thread.

Each per-span field becomes one array of fixed-width little-endian values (numpy
reads them straight from the span objects); attributes of the whole batch are one
JSON document.
"""
import json
from operator import attrgetter

import numpy as np
import orjson

from ..proto import pb

_M64 = (1 << 64) - 1
_U64, _I64, _U32 = np.dtype("<u8"), np.dtype("<i8"), np.dtype("<u4")

_trace_id = attrgetter("trace_id")
_span_id = attrgetter("span_id")
_parent_id = attrgetter("parent_id")
_start = attrgetter("start")
_end = attrgetter("end_ns")
_kind = attrgetter("kind")
_thread = attrgetter("thread")
_attributes = attrgetter("attributes")
_name = attrgetter("name")
_extras_of = attrgetter("extras")


def _column(dtype: np.dtype, values, n: int) -> bytes:
    return np.fromiter(values, dtype=dtype, count=n).tobytes()


def _json_value(value):
    """Attribute values JSON cannot hold (bytes, sets, arbitrary objects) travel as text."""
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return str(value)


def dumps(value) -> bytes:
    """UTF-8 JSON. orjson is ~5x faster than json; json takes what orjson refuses
    (integers beyond 64 bits)."""
    try:
        return orjson.dumps(value, default=_json_value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=_json_value).encode()


def _sparse(spans) -> tuple[bytes, bytes]:
    """(status column, extras JSON) from the few spans that have SpanExtras."""
    status = bytearray(len(spans))
    rows = []
    for i, x in enumerate(map(_extras_of, spans)):
        if x is None:
            continue
        status[i] = x.status
        extra = {}
        if x.events:
            extra["events"] = [[name, t, attrs] for name, t, attrs in x.events]
        if x.links:
            extra["links"] = [[f"{l.context.trace_id:032x}", f"{l.context.span_id:016x}",
                               dict(l.attributes) if l.attributes else None] for l in x.links]
        if x.status_message is not None:
            extra["status_message"] = x.status_message
        if extra:
            rows.append([i, extra])
    return bytes(status), dumps(rows) if rows else b""


def encode_spans(batch: "pb.SpanBatch", spans: list) -> None:
    """Fill the span columns of `batch` from a list of ended crosstrace Spans."""
    trace_ids = list(map(_trace_id, spans))
    names = list(map(_name, spans))
    strings = {name: i for i, name in enumerate(set(names))}
    n = batch.count = len(spans)
    batch.trace_id_hi = _column(_U64, [t >> 64 for t in trace_ids], n)
    batch.trace_id_lo = _column(_U64, [t & _M64 for t in trace_ids], n)
    batch.span_id = _column(_U64, map(_span_id, spans), n)
    batch.parent_span_id = _column(_U64, map(_parent_id, spans), n)
    batch.start_ns = _column(_I64, map(_start, spans), n)
    batch.end_ns = _column(_I64, map(_end, spans), n)
    batch.kind = bytes(map(_kind, spans))
    batch.name = _column(_U32, map(strings.__getitem__, names), n)
    batch.thread = _column(_U64, map(_thread, spans), n)
    batch.strings.extend(strings)
    batch.attributes_json = dumps(list(map(_attributes, spans)))
    batch.status, batch.extras_json = _sparse(spans)
