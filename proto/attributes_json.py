"""The JSON of a batch's attributes and extras (SpanBatch.attributes_json, extras_json), as
tracers and the collector's OTLP receiver write it."""
import json
import math

import orjson


def _json_value(value):
    """Attribute values JSON cannot hold (bytes, sets, arbitrary objects) travel as text."""
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return str(value)


# Leads a document json wrote (integers beyond 64 bits, NaN, ...): its readers read it with
# json, where orjson would round such integers to floats. JSON allows leading whitespace.
JSON_WRITTEN = b"\n"


def dumps(value) -> bytes:
    """UTF-8 JSON. orjson is ~5x faster than json, and plain orjson (string keys, JSON
    types) twice as fast again as with the options that take the rest; json takes what
    orjson refuses (integers beyond 64 bits), and its document starts with JSON_WRITTEN.
    orjson writes a NaN or an infinity as null, which would hide a loss gone NaN: where it
    wrote more nulls than a batch has spans without attributes, and a value is a NaN or an
    infinity, json writes the whole document again, with NaN and Infinity (which the
    collector reads)."""
    try:
        data = orjson.dumps(value)
    except TypeError:
        try:
            data = orjson.dumps(value, default=_json_value, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:
            data = None
    if data is not None and (data.count(b"null") == _nones(value) or not _non_finite(value)):
        return data
    try:   # a lone surrogate (which orjson refuses) is written as '?': UTF-8 has no such character
        return JSON_WRITTEN + json.dumps(value, separators=(",", ":"), default=_json_value,
                                         ensure_ascii=False).encode("utf-8", "replace")
    except TypeError:   # keys json cannot write: orjson's text of them, nulls and all
        if data is not None:
            return data
        return dumps(_keys_as_text(value))   # keys neither writes (a tuple): their text


def _keys_as_text(value):
    """`value` with every dict key that is not text made its text (a tuple key dropped its
    span, where OpenTelemetry's SDK keeps the span and warns)."""
    if isinstance(value, dict):
        return {key if type(key) is str else str(key): _keys_as_text(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_keys_as_text(item) for item in value]
    return value


def _nones(value) -> int:
    """The nulls a batch's own list holds (spans without attributes), found at C speed."""
    return value.count(None) if isinstance(value, list) else 0


def _non_finite(value) -> bool:
    """Whether a NaN or an infinity is anywhere in `value`: a walk (without recursion or
    generators, the cheapest in Python), on the rare batch where orjson wrote a null it was
    not given at the top. orjson refuses cycles, so there are none."""
    stack = [value]
    isfinite = math.isfinite
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            if not isfinite(item):
                return True
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            stack.extend(item)
    return False
