"""Ended spans -> one columnar SpanBatch, on the exporter thread.

The export queue holds one tuple per ended span, in the order of RECORD_FIELDS (the
hot path builds it from the span's slots: cheaper than a second pass over span objects
here). zip() turns a batch of them into columns in C; each column becomes an array of
fixed-width little-endian values, and the attributes of the whole batch one JSON document.
"""
import json
import numpy as np
import orjson

from ..proto import pb

_M64 = (1 << 64) - 1
_U64, _I64, _U32 = np.dtype("<u8"), np.dtype("<i8"), np.dtype("<u4")

RECORD_FIELDS = ("trace_id", "span_id", "parent_id", "start", "end", "kind", "thread", "name", "attributes",
                 "extras")


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


def _sparse(extras) -> tuple[bytes, bytes]:
    """(status column, extras JSON) from the few spans that have SpanExtras."""
    status = bytearray(len(extras))
    rows = []
    for i, x in enumerate(extras):
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


def encode_spans(batch: "pb.SpanBatch", records: list) -> None:
    """Fill the span columns of `batch` from the export queue's records (RECORD_FIELDS)."""
    trace_ids, span_ids, parent_ids, starts, ends, kinds, threads, names, attributes, extras = zip(*records)
    strings = {name: i for i, name in enumerate(set(names))}
    n = batch.count = len(records)
    batch.trace_id_hi = _column(_U64, [t >> 64 for t in trace_ids], n)
    batch.trace_id_lo = _column(_U64, [t & _M64 for t in trace_ids], n)
    batch.span_id = np.array(span_ids, dtype=_U64).tobytes()
    batch.parent_span_id = np.array(parent_ids, dtype=_U64).tobytes()
    batch.start_ns = np.array(starts, dtype=_I64).tobytes()
    batch.end_ns = np.array(ends, dtype=_I64).tobytes()
    batch.kind = bytes(kinds)
    batch.name = _column(_U32, map(strings.__getitem__, names), n)
    batch.thread = np.array(threads, dtype=_U64).tobytes()
    batch.strings.extend(strings)
    batch.attributes_json = dumps(attributes)
    batch.status, batch.extras_json = _sparse(extras)
