"""Decode and check one incoming batch before it reaches the store.

A batch that cannot be read as a whole (undecodable, inconsistent columns, bad JSON,
no node id) raises BadBatch, which the server turns into INVALID_ARGUMENT. Spans that
are bad on their own are rejected one by one and counted by reason; the rest of the
batch goes on to be stored.
"""
import collections
import dataclasses

import numpy as np
from google.protobuf.message import DecodeError

from ..proto import pb
from .columns import BadBatch, check_object, parse_json_columns, too_deep, view

MAX_SPANS_PER_BATCH = 1 << 20
MAX_INT64 = (1 << 63) - 1
# Local monotonic clocks count from boot; anything beyond ~146 years is garbage.
MAX_ABS_TIMESTAMP_NS = 1 << 62
MAX_DURATION_NS = 30 * 24 * 3600 * 10**9
# A clock sample whose error bound (or round trip) is over an hour says nothing about a clock
# (NTP's own bound stops at 16 s), and bounds of years broke the fit's float geometry.
MAX_CLOCK_ERROR_NS = 3600 * 10**9
MAX_KIND = max(pb.SpanKind.values())
MAX_STATUS = 2


class TooLarge(BadBatch):
    """The batch holds more spans than one batch may (RESOURCE_EXHAUSTED)."""


class StoreUnavailable(RuntimeError):
    """A batch could not be made durable (store or relay spool failed, or the collector is
    busy or stopping); the client retries."""


@dataclasses.dataclass
class CheckedBatch:
    batch: "pb.SpanBatch"
    cols: dict[str, np.ndarray]
    keep: np.ndarray                  # spans that passed every check
    attributes: list
    extras: dict[int, dict]
    rejected: collections.Counter     # reason -> spans (or clock samples)
    samples: list                     # the batch's clock samples that passed their checks

    @property
    def node_id(self) -> str:
        return self.batch.resource.node_id


def decode(data: bytes) -> "pb.SpanBatch":
    try:
        return pb.SpanBatch.FromString(data)
    except DecodeError as exc:
        raise BadBatch(f"undecodable SpanBatch ({len(data)} bytes): {exc}") from None


def check(batch: "pb.SpanBatch") -> CheckedBatch:
    if not batch.resource.node_id:
        raise BadBatch(f"batch seq={batch.seq}: resource.node_id is empty")
    if batch.count > MAX_SPANS_PER_BATCH:
        raise TooLarge(f"batch seq={batch.seq} holds {batch.count} spans; at most {MAX_SPANS_PER_BATCH} per batch")
    if batch.seq > MAX_INT64 or batch.dropped_spans > MAX_INT64:   # the store keeps them as SQLite integers
        raise BadBatch(f"batch seq={batch.seq}, dropped_spans={batch.dropped_spans}: at most {MAX_INT64}")
    if batch.resource.attributes_json:   # read back by every OTLP export: one that breaks breaks them all
        check_object(batch.resource.attributes_json, "resource.attributes_json")
    cols = view(batch)
    attributes, extras, not_object = parse_json_columns(batch)
    start, end = cols["start_ns"], cols["end_ns"]
    # Compared directly, not through abs() and a difference, which wrap around at the int64 limits.
    sane = (start >= -MAX_ABS_TIMESTAMP_NS) & (start <= MAX_ABS_TIMESTAMP_NS) & \
        (end >= -MAX_ABS_TIMESTAMP_NS) & (end <= MAX_ABS_TIMESTAMP_NS)
    reasons = (
        ("invalid_trace_id", (cols["trace_id_hi"] == 0) & (cols["trace_id_lo"] == 0)),
        ("invalid_span_id", cols["span_id"] == 0),
        ("absurd_timestamp", ~sane),
        ("end_before_start", end < start),
        ("absurd_duration", sane & ((end - start) > MAX_DURATION_NS)),
        ("unknown_kind", cols["kind"] > MAX_KIND),
        ("unknown_status", cols["status"] > MAX_STATUS),
        ("bad_name_index", cols["name"] >= len(batch.strings)),
        ("attributes_or_extras_not_an_object", not_object),
        ("attributes_too_deep", too_deep(attributes, extras)),
    )
    keep = np.ones(batch.count, dtype=bool)
    rejected = collections.Counter()
    for reason, bad in reasons:
        bad = bad & keep  # count each span under its first reason only
        n = int(bad.sum())
        if n:
            rejected[reason] += n
            keep &= ~bad
    samples = [sample for sample in batch.clock_samples if _sane(sample)]
    if len(samples) < len(batch.clock_samples):
        rejected["absurd_clock_sample"] += len(batch.clock_samples) - len(samples)
    return CheckedBatch(batch, cols, keep, attributes, extras, rejected, samples)


_TWO_WAY = (pb.GRPC_EXCHANGE, pb.UDP_EXCHANGE, pb.RPC_PIGGYBACK)
_SOURCES = (*_TWO_WAY, pb.NTP, pb.PTP)


def _sane(s: "pb.ClockSample") -> bool:
    """A clock sample of a source the collector reads, whose times could be readings (as
    spans' timestamps are checked), with an error bound of at most an hour and a two-way
    exchange that took no negative time at either end, nor more than an hour, between clocks
    no further apart than a timestamp may be: one absurd sample (INT64_MIN) broke every
    report of its store, and one of clocks 2^63 ns apart wrapped around in its node's model."""
    if s.source not in _SOURCES:
        return False
    times = (s.t1, s.t2, s.t3, s.t4, s.local_ns, s.offset_ns)
    if not all(-MAX_ABS_TIMESTAMP_NS <= t <= MAX_ABS_TIMESTAMP_NS for t in times):
        return False
    if not 0 <= s.error_ns <= MAX_CLOCK_ERROR_NS:
        return False
    return s.source not in _TWO_WAY or (0 <= s.t4 - s.t1 <= MAX_CLOCK_ERROR_NS and s.t3 >= s.t2
                                        and abs(s.t2 - s.t1) <= MAX_ABS_TIMESTAMP_NS)
