"""Numpy views of a SpanBatch's columns, and subsets of a batch.

The same columnar SpanBatch is the wire format and the on-disk segment format, so
ingest and read both go through these views.
"""
import json
import math

import numpy as np
import orjson

from ..proto import pb
from ..proto.attributes_json import JSON_WRITTEN
from ..proto.attributes_json import dumps as write_json

# (field, dtype): one fixed-width little-endian value per span.
COLUMNS = (
    ("trace_id_hi", np.dtype("<u8")),
    ("trace_id_lo", np.dtype("<u8")),
    ("span_id", np.dtype("<u8")),
    ("parent_span_id", np.dtype("<u8")),
    ("start_ns", np.dtype("<i8")),
    ("end_ns", np.dtype("<i8")),
    ("kind", np.dtype("u1")),
    ("status", np.dtype("u1")),
    ("name", np.dtype("<u4")),
    ("thread", np.dtype("<u8")),
)


def loads(data: bytes):
    """orjson, with json's leniency for NaN and Infinity (what tracers write for a float
    JSON has no number for), which are read as the strings proto3's JSON mapping uses:
    what crosstrace writes for other tools (JSON lines, Perfetto) stays strict JSON.
    json reads what json wrote (JSON_WRITTEN): integers beyond 64 bits (a UUID's int),
    which orjson would round to floats. Nesting too deep for either is a ValueError like
    any other bad JSON."""
    try:
        if not data.startswith(JSON_WRITTEN):
            return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data, parse_constant=str, parse_float=_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _float(text: str):
    """A number too large for a float (1e400, which orjson refuses) is an infinity: read as
    the string an infinity written by a tracer is read as."""
    value = float(text)
    return value if math.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")


def dumps(value, indent: bool = False) -> bytes:
    """JSON; `indent`: by two, keys that are not strings written as json writes them."""
    try:
        return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS if indent else None)
    except TypeError:  # integers beyond 64 bits
        return (json.dumps(value, indent=2) if indent else json.dumps(value, separators=(",", ":"))).encode()


_ATTRIBUTE_TYPES = {dict, type(None)}


class BadBatch(ValueError):
    """The batch as a whole cannot be read; the message says why."""


def view(batch: "pb.SpanBatch") -> dict[str, np.ndarray]:
    """Zero-copy arrays over the span columns; BadBatch when a column's size is off."""
    n = batch.count
    out = {}
    for field, dtype in COLUMNS:
        raw = getattr(batch, field)
        if len(raw) != n * dtype.itemsize:
            raise BadBatch(f"column {field} has {len(raw)} bytes; expected {dtype.itemsize} per span "
                           f"x count={n} = {n * dtype.itemsize}")
        out[field] = np.frombuffer(raw, dtype=dtype)
    return out


def parse_json_columns(batch: "pb.SpanBatch") -> tuple[list, dict[int, dict], np.ndarray]:
    """(attributes per span, extras by span index, per span whether its own entry is not an
    object): a span with such an entry is rejected alone, the rest of its batch kept;
    BadBatch when the columns do not fit the batch, which no span can be told apart in."""
    n = batch.count
    not_object = np.zeros(n, dtype=bool)
    if batch.attributes_json:
        try:
            attributes = loads(batch.attributes_json)
        except ValueError as exc:
            raise BadBatch(f"attributes_json is not valid JSON: {exc}") from None
        if not isinstance(attributes, list) or len(attributes) != n:
            raise BadBatch(f"attributes_json must be a JSON array of count={n} entries")
        if not set(map(type, attributes)) <= _ATTRIBUTE_TYPES:
            for i, value in enumerate(attributes):
                if type(value) not in _ATTRIBUTE_TYPES:
                    not_object[i], attributes[i] = True, None
    else:
        attributes = [None] * n
    extras: dict[int, dict] = {}
    if batch.extras_json:
        try:
            rows = loads(batch.extras_json)
            for index, extra in rows:
                if type(index) is not int or not 0 <= index < n:
                    raise ValueError(f"span index {index!r}")
                if type(extra) is dict:
                    extras[index] = extra
                else:
                    not_object[index] = True
        except (ValueError, TypeError) as exc:
            raise BadBatch(f"extras_json must be a JSON array of [span_index, object]: {exc}") from None
    return attributes, extras, not_object


# Deepest nesting kept: json writes what orjson cannot (beyond 254 levels) while Python's
# recursion limit (1000, less the caller's stack) allows; half of it leaves room anywhere.
MAX_NESTING = 500


def too_deep(attributes: list, extras: dict[int, dict]) -> np.ndarray:
    """Per span: its attributes or extras nest deeper than MAX_NESTING, so that the store's
    segments and every export would fail on them. One orjson pass over the batch (it writes
    254 levels); span by span only where that fails."""
    bad = np.zeros(len(attributes), dtype=bool)
    for values, indices in ((attributes, None), (list(extras.values()), list(extras))):
        try:
            orjson.dumps(values)
            continue
        except TypeError:   # nested deeper than orjson writes, or an integer beyond 64 bits
            pass
        for k, value in enumerate(values):
            if _nesting(value) > MAX_NESTING:
                bad[k if indices is None else indices[k]] = True
    return bad


def check_object(data: bytes, what: str) -> None:
    """BadBatch unless `data` is a JSON object nested at most MAX_NESTING deep."""
    try:
        value = loads(data)
    except ValueError as exc:
        raise BadBatch(f"{what} is not valid JSON: {exc}") from None
    if type(value) is not dict or _nesting(value) > MAX_NESTING:
        raise BadBatch(f"{what} must be a JSON object at most {MAX_NESTING} levels deep")


def _nesting(value) -> int:
    """How deep lists and objects nest in `value` (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if type(value) is dict:
            value = value.values()
        elif type(value) is not list:
            continue
        deepest = max(deepest, depth)
        stack.extend((item, depth + 1) for item in value)
    return deepest


def take(batch: "pb.SpanBatch", cols: dict[str, np.ndarray], keep: np.ndarray,
         attributes: list, extras: dict[int, dict]) -> "pb.SpanBatch":
    """A segment holding only the spans where `keep` is True (resource and clock samples dropped)."""
    out = pb.SpanBatch(count=int(keep.sum()))
    for field, _ in COLUMNS:
        setattr(out, field, cols[field][keep].tobytes())
    out.strings.extend(batch.strings)
    index = np.flatnonzero(keep)
    out.attributes_json = write_json([attributes[i] for i in index])   # what loads() reads back exactly
    remap = {int(old): new for new, old in enumerate(index)}
    kept = [[remap[i], extra] for i, extra in extras.items() if i in remap]
    out.extras_json = write_json(kept) if kept else b""
    return out
