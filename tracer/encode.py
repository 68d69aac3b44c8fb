"""Queued spans -> one columnar SpanBatch, on the exporter thread.

A queued span is what Span.end() puts in the export queue: the FIELDS values (trace_id,
span_id, parent_id, name, kind, start, end, thread, extras, attributes), one after the
other. The exporter takes them as one list per field; each becomes one array of
fixed-width little-endian values, and the attributes of the whole batch one JSON document.
"""
import numpy as np

from ..proto import pb
from ..proto.attributes_json import dumps
from .compiled import hot_path

FIELDS = 10   # values per queued span, in the order above
_U64, _I64, _U32 = np.dtype("<u8"), np.dtype("<i8"), np.dtype("<u4")


def _column(dtype: np.dtype, values, n: int) -> bytes:
    return np.fromiter(values, dtype=dtype, count=n).tobytes()


if hot_path is not None:   # the id and time columns in C, several times faster: encoding holds the GIL
    _u64_column, _i64_column, _u128_columns = hot_path.pack_u64, hot_path.pack_i64, hot_path.pack_u128
else:
    def _u64_column(values: list) -> bytes:
        return _column(_U64, values, len(values))

    def _i64_column(values: list) -> bytes:
        return _column(_I64, values, len(values))

    def _u128_columns(ids: list) -> tuple[bytes, bytes]:
        """128-bit ids as (high, low) u64 columns: 16 little-endian bytes each, read as
        (lo, hi) pairs of u64 (half the cost of shifts)."""
        pairs = np.frombuffer(b"".join([t.to_bytes(16, "little") for t in ids]), _U64)
        return pairs[1::2].tobytes(), pairs[0::2].tobytes()


def _sparse(extras: list) -> tuple[bytes, bytes]:
    """(status column, extras JSON) from the few spans that have SpanExtras."""
    if extras.count(None) == len(extras):
        return bytes(len(extras)), b""
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
            extra["links"] = [_link(l) for l in x.links]
        if x.status_message is not None:
            extra["status_message"] = x.status_message
        if x.trace_state:
            extra["trace_state"] = x.trace_state.to_header()
        if extra:
            rows.append([i, extra])
    return bytes(status), dumps(rows) if rows else b""


def _link(link) -> list:
    """[trace id, span id, attributes] and the trace state where there is one."""
    ctx = link.context
    row = [f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", dict(link.attributes) if link.attributes else None]
    if ctx.trace_state:
        row.append(ctx.trace_state.to_header())
    return row


def batches(columns: list[list], next_size):
    """Queued spans' columns in parts, each of at most next_size() spans (asked anew for
    each part, which can follow what the part before encoded to): one part (maybe empty)
    at least."""
    n, size = len(columns[0]), next_size()
    if n <= size:
        yield columns
        return
    start = 0
    while start < n:
        yield [column[start:start + size] for column in columns]
        start += size
        size = next_size()


def encode_spans(batch: "pb.SpanBatch", columns: list[list]) -> None:
    """Fill the span columns of `batch` from queued spans, given as one list per field."""
    trace_ids, span_ids, parent_ids, names, kinds, starts, ends, threads, extras, attributes = columns
    strings = {name: i for i, name in enumerate(set(names))}
    n = batch.count = len(names)
    batch.trace_id_hi, batch.trace_id_lo = _u128_columns(trace_ids)
    batch.span_id = _u64_column(span_ids)
    batch.parent_span_id = _u64_column(parent_ids)
    batch.start_ns = _i64_column(starts)
    batch.end_ns = _i64_column(ends)
    batch.kind = bytes(kinds)
    batch.name = _column(_U32, map(strings.__getitem__, names), n)
    batch.thread = _u64_column(threads)
    try:
        batch.strings.extend(strings)
    except (UnicodeEncodeError, TypeError):   # a lone surrogate in a name (protobuf takes UTF-8 only), or a
        batch.strings.extend(_text(name) for name in strings)   # name not given as text (start_span(123))
    batch.attributes_json = dumps(attributes)
    batch.status, batch.extras_json = _sparse(extras)


def _text(name) -> str:
    """A span's name as UTF-8 text: the SDK takes any object as a name, and so its spans
    were dropped here."""
    return (name if type(name) is str else str(name)).encode("utf-8", "replace").decode()


def encoded_size(batch: "pb.SpanBatch") -> int:
    """About the size of `batch` encoded, from its large fields (ByteSize() costs as much as
    serializing): the columns, the names and the JSON."""
    return (62 * batch.count + sum(map(len, batch.strings)) + len(batch.attributes_json)
            + len(batch.extras_json))
