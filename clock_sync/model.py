"""A node's clock model: how its local clock maps onto a reference timeline.

offset(t) = local - reference, as a function of local time t; positive: the node's clock
is ahead. The model is piecewise: one Segment per stretch of samples over which the clock
was linear (a step or a change of drift starts a new one). Each segment keeps its
estimate line and the polygon of every line its bounds allow, so every mapped time comes
with the exact interval the evidence leaves open at that time: tight where samples are
dense, widening with the drift uncertainty away from them.
"""
import dataclasses
import math

import numpy as np

from . import geometry


@dataclasses.dataclass(frozen=True)
class Segment:
    start_ns: int             # local time of the first sample it was fitted from
    end_ns: int               # ... and of the last
    t0: int                   # local time where the line's `a` holds
    a: float                  # estimate: offset (ns) at t0
    b: float                  # estimate: drift in ns per second (ppm * 1000)
    polygon: np.ndarray       # (V, 2) feasible (a, b) around t0; see geometry
    samples: int = 0
    bridge: bool = False      # spans a step or drift change: its polygon is the union of lines

    def estimate(self, t) -> np.ndarray:
        return self.a + self.b * _seconds(t, self.t0)

    def bounds(self, t) -> tuple[np.ndarray, np.ndarray]:
        return geometry.extent(self.polygon, _seconds(t, self.t0))


def _seconds(t, t0: int) -> np.ndarray:
    return (np.asarray(t, dtype=np.int64) - t0).astype(np.float64) / 1e9


@dataclasses.dataclass(frozen=True)
class ClockModel:
    segments: tuple = ()      # Segment, ordered by start_ns
    samples: int = 0
    sources: tuple = ()       # names of the sources the estimate rests on
    flags: tuple = ()         # what a reader should know: rejected sources, outliers, violations
    # Piecewise-linear move of the estimate (knot local times, ns moved), from causal
    # refinement: it keeps the estimate inside the bounds, which it leaves as they are.
    correction: tuple = ()

    # -- evaluation -------------------------------------------------------------------------

    def offset_at(self, local) -> np.ndarray:
        return self.evaluate(local)[0]

    def bounds_at(self, local) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi): the true offset at each local time lies in [lo, hi]."""
        _, lo, hi = self.evaluate(local)
        return lo, hi

    def error_at(self, local) -> np.ndarray:
        """Bound on |true offset - offset_at| at each local time (inf without segments)."""
        est, lo, hi = self.evaluate(local)
        return np.maximum(est - lo, hi - est)

    def to_reference(self, local) -> np.ndarray:
        """Reference-time ns (int64) for local-time ns."""
        local = np.asarray(local, dtype=np.int64)
        return local - np.rint(self.offset_at(local)).astype(np.int64)

    def segment_of(self, local) -> np.ndarray:
        """Index of the one segment whose line holds at each local time; -1 in a
        transition between two, where either may."""
        t = np.asarray(local, dtype=np.int64)
        index = np.zeros(t.shape, dtype=np.int64)
        for i, (left, right) in enumerate(zip(self.segments, self.segments[1:])):
            begin, end = _transition(left, right)
            index[t >= begin] = -1
            index[t - begin >= max(end - begin, 1)] = i + 1
        return index

    def evaluate(self, local):
        """(estimate, lo, hi) at each local time, in one pass over the segments. The times
        are taken in order, and each hand-over only over those it decides: from its begin
        to where the next one has taken over entirely (not every later time: a run of
        hours has dozens of segments, and that was segments x times)."""
        t = np.asarray(local, dtype=np.int64)
        shape, t = t.shape, t.reshape(-1)
        if not self.segments:
            zero = np.zeros(shape)
            return zero, zero - math.inf, zero + math.inf
        order = None
        if len(self.segments) > 1 and len(t) > 1 and (t[1:] < t[:-1]).any():
            order = np.argsort(t, kind="stable")
            t = t[order]
        est, lo, hi = _segment_values(self.segments[0], t)
        takeovers = [_transition(left, right) for left, right in zip(self.segments, self.segments[1:])]
        for i, (begin, end) in enumerate(takeovers):
            # Past segment i, segment i+1 takes over; where they overlap or leave a gap (a step
            # or a drift change happened somewhere in there) blend the estimates and take the
            # union of the intervals.
            first = int(np.searchsorted(t, begin))
            if first == len(t):
                break
            last = len(t)
            if i + 1 < len(takeovers):   # from here on the next hand-over decides alone
                next_begin, next_end = takeovers[i + 1]
                last = max(first, int(np.searchsorted(t, next_begin + max(next_end - next_begin, 1))))
            part = slice(first, last)
            r_est, r_lo, r_hi = _segment_values(self.segments[i + 1], t[part])
            w = np.clip((t[part] - begin) / max(end - begin, 1), 0.0, 1.0)
            inside = w < 1.0
            est[part] = (1 - w) * est[part] + w * r_est
            lo[part] = np.where(inside, np.minimum(lo[part], r_lo), r_lo)
            hi[part] = np.where(inside, np.maximum(hi[part], r_hi), r_hi)
        if self.correction:
            knots, shift = self.correction
            est = est + np.interp(t.astype(np.float64), knots.astype(np.float64), shift)
        if order is not None:
            unsorted = np.empty_like(order)
            unsorted[order] = np.arange(len(order))
            est, lo, hi = est[unsorted], lo[unsorted], hi[unsorted]
        return est.reshape(shape), lo.reshape(shape), hi.reshape(shape)

    # -- summaries (the report's clocks section) ---------------------------------------------

    @property
    def known(self) -> bool:
        return bool(self.segments)

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    @property
    def offset_ns(self) -> float:
        return self.current.a if self.segments else 0.0

    @property
    def drift_ppm(self) -> float:
        return self.current.b / 1000 if self.segments else 0.0

    @property
    def at_ns(self) -> int:
        return self.current.t0 if self.segments else 0

    @property
    def span_ns(self) -> tuple[int, int]:
        """Local time range covered by samples."""
        return (self.segments[0].start_ns, self.segments[-1].end_ns) if self.segments else (0, 0)

    @property
    def error_ns(self) -> float:
        """Largest error bound over the sampled time range (bounds are convex in time
        within a segment, so the segment ends and transitions are where to look)."""
        if not self.segments:
            return math.inf
        points = sorted({p for s in self.segments for p in (s.start_ns, s.end_ns, s.t0)})
        return float(self.error_at(np.array(points, dtype=np.int64)).max())

    @property
    def drift_error_ppm(self) -> float:
        """Half the range of drifts the current segment allows."""
        if not self.segments:
            return math.inf
        b = self.current.polygon[:, 1]
        return float(max(b.max() - self.current.b, self.current.b - b.min()) / 1000)

    def corrected(self, knots_ns: np.ndarray, shift_ns: np.ndarray) -> "ClockModel":
        return dataclasses.replace(self, correction=(np.asarray(knots_ns, dtype=np.int64),
                                                     np.asarray(shift_ns, dtype=np.float64)))

    def with_flags(self, *flags: str) -> "ClockModel":
        return dataclasses.replace(self, flags=tuple(dict.fromkeys(self.flags + flags)))


def _transition(left: Segment, right: Segment) -> tuple[int, int]:
    """Where `left` hands over to `right`: their overlap, or the gap between them."""
    return min(right.start_ns, left.end_ns), max(right.start_ns, left.end_ns)


def _segment_values(segment: Segment, t: np.ndarray):
    lo, hi = segment.bounds(t)
    return segment.estimate(t), lo, hi


def unknown(samples: int = 0, flags: tuple = ("no_samples",)) -> ClockModel:
    """No usable samples: identity mapping with an unbounded error."""
    return ClockModel((), samples, (), flags)


def line(offset_ns: float, drift_ppm: float, at_ns: int, error_ns: float, **fields) -> ClockModel:
    """A model that is one known line with a constant error bound (a link given from
    outside, such as the collector's own wall clock)."""
    b = drift_ppm * 1000
    polygon = np.array([[offset_ns - error_ns, b], [offset_ns + error_ns, b]], dtype=np.float64)
    return ClockModel((Segment(at_ns, at_ns, at_ns, offset_ns, b, polygon),), **fields)
