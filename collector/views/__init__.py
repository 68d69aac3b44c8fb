import contextlib
import sys

from ...proto.semconv import NODE_CLOCK_TIMES, Status
from ..ingest import MAX_ABS_TIMESTAMP_NS

STATUS_NAMES = {s.value: s.name for s in Status}


def open_output(path: str):
    """The binary file a view is written to; '-' is stdout (left open)."""
    return contextlib.nullcontext(sys.stdout.buffer) if path == "-" else open(path, "wb")


PLAIN = {"status": STATUS_NAMES[Status.UNSET], "status_message": None, "events": (), "links": ()}


def outcome(t, al, row: int) -> dict:
    """A span's status, its message, its events (exceptions among them) on the aligned
    timeline and its links: what an OTLP export sends of a span beyond its times and
    attributes, for the views that show one record per span. Most spans have none of it:
    they share one record (not to be changed)."""
    if not t.status[row] and row not in t.extras:
        return PLAIN
    extra = t.extras.get(row, {})
    events = entries(extra, "events", 3)
    times = al.to_reference(t.nodes[t.node[row]], [e[1] for e in events]).tolist() if events else []
    return {"status": STATUS_NAMES.get(int(t.status[row]), str(t.status[row])),
            "status_message": extra.get("status_message") or None,
            "events": [{"name": str(name), "time_ns": when, "attributes": attrs or {}}
                       for (name, _, attrs), when in zip(events, times)],
            "links": [{"trace_id": trace_hex, "span_id": span_hex, "attributes": attrs or {}}
                      for trace_hex, span_hex, attrs, *_ in entries(extra, "links", 3)]}


def placed_attributes(attributes: dict | None, place) -> dict:
    """A span's attributes, those that are times on its node's clock (NODE_CLOCK_TIMES)
    placed as its start and end are: `place` maps a list of such times."""
    attributes = attributes or {}
    times = [key for key in NODE_CLOCK_TIMES if _a_time(attributes.get(key))]
    if not times:
        return attributes
    return {**attributes, **dict(zip(times, place([attributes[key] for key in times])))}


def _a_time(value) -> bool:
    """A time on a node's clock that can be placed: within the bound that ingest holds
    spans' times to; one near int64's limits wrapped around when placed."""
    return type(value) is int and abs(value) <= MAX_ABS_TIMESTAMP_NS


def aligned_attributes(t, al, row: int) -> dict:
    """placed_attributes on the aligned timeline (the JSONL and Perfetto views')."""
    return placed_attributes(t.attributes[row], lambda local: al.to_reference(t.nodes[t.node[row]], local).tolist())


def entries(extra: dict, key: str, width: int) -> list:
    """The events or links of a span's extras that have their shape; the collector stores a
    client's extras as sent, and one malformed entry must not stop an export."""
    found = extra.get(key)
    if not isinstance(found, list):
        return []
    return [e for e in found if isinstance(e, list) and len(e) >= width and _well_formed(key, e)]


def _well_formed(key: str, entry: list) -> bool:
    if not (entry[2] is None or isinstance(entry[2], dict)):
        return False
    if key == "events":
        return _a_time(entry[1])
    try:
        return len(bytes.fromhex(entry[0])) == 16 and len(bytes.fromhex(entry[1])) == 8
    except (TypeError, ValueError):
        return False
