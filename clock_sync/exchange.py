"""Clock samples as hard bounds on a node's offset (offset = local - reference).

A two-way exchange (t1 local send, t2 reference receive, t3 reference send, t4 local
receive) bounds the offset whatever the path asymmetry: the request cannot arrive
before it was sent, so offset(t1) >= t1 - t2, nor the reply, so offset(t4) <= t4 - t3.
The interval's width is the round-trip delay. A one-way source (NTP, PTP as read from a
daemon) gives an offset and an error bound at one local time.
"""
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Sample i says offset(lo_t[i]) >= lo[i] and offset(hi_t[i]) <= hi[i]."""
    lo_t: np.ndarray    # int64 local ns
    lo: np.ndarray      # float64 ns
    hi_t: np.ndarray
    hi: np.ndarray

    def __len__(self) -> int:
        return len(self.lo)

    @property
    def t(self) -> np.ndarray:
        """One local time per sample (the middle of its two)."""
        return self.lo_t + (self.hi_t - self.lo_t) // 2

    @property
    def width(self) -> np.ndarray:
        return self.hi - self.lo

    @property
    def mid(self) -> np.ndarray:
        return (self.lo + self.hi) / 2

    def take(self, rows) -> "Bounds":
        return Bounds(self.lo_t[rows], self.lo[rows], self.hi_t[rows], self.hi[rows])

    def widened(self, lo_by, hi_by) -> "Bounds":
        """Bounds moved by another interval (composition along a path: bounds add)."""
        return Bounds(self.lo_t, self.lo + lo_by, self.hi_t, self.hi + hi_by)

    def sorted(self) -> "Bounds":
        return self.take(np.argsort(self.t, kind="stable"))


def empty() -> Bounds:
    return Bounds(np.empty(0, np.int64), np.empty(0), np.empty(0, np.int64), np.empty(0))


def concat(parts: list[Bounds]) -> Bounds:
    parts = [p for p in parts if len(p)]
    if not parts:
        return empty()
    return Bounds(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("lo_t", "lo", "hi_t", "hi")))


def offset_bounds(t1, t2, t3, t4):
    """Interval [lo, hi] that must contain offset = local - reference, whatever the path
    asymmetry: lo = t1 - t2 (at local t1), hi = t4 - t3 (at local t4)."""
    t1, t2, t3, t4 = (np.asarray(t, dtype=np.int64) for t in (t1, t2, t3, t4))
    return t1 - t2, t4 - t3


def from_exchanges(t1, t2, t3, t4) -> Bounds:
    t1, t4 = np.asarray(t1, dtype=np.int64), np.asarray(t4, dtype=np.int64)
    lo, hi = offset_bounds(t1, t2, t3, t4)
    return Bounds(t1, lo.astype(np.float64), t4, hi.astype(np.float64))


def from_offsets(local_ns, ref_minus_local_ns, error_ns) -> Bounds:
    """One-way samples as the wire carries them (reference - local, +- error)."""
    t = np.asarray(local_ns, dtype=np.int64)
    offset = -np.asarray(ref_minus_local_ns, dtype=np.float64)
    error = np.abs(np.asarray(error_ns, dtype=np.float64))
    return Bounds(t, offset - error, t.copy(), offset + error)


def valid(bounds: Bounds, max_drift_ppm: float = 0.0) -> np.ndarray:
    """Samples that can be true. The lower bound holds at lo_t and the upper at hi_t, and
    the offset may drift by up to max_drift_ppm in between: an honest 10 s call on a clock
    20 ppm slow has hi 200 us below lo over a 100 us path. Beyond that the timestamps are
    broken."""
    return bounds.hi - bounds.lo >= -max_drift_ppm * 1e-6 * np.abs(bounds.hi_t - bounds.lo_t)


def bursts(t: np.ndarray, gap_ns: int) -> np.ndarray:
    """Burst number of each sample (sorted by time): a new burst after a pause > gap_ns."""
    return np.concatenate([[0], np.cumsum(np.diff(t) > gap_ns)]).astype(np.int64) if len(t) else np.empty(0, np.int64)


@dataclasses.dataclass(frozen=True)
class OffsetSample:
    """A one-way reading, as NTP and PTP sources produce and the wire carries it: at local
    time local_ns, reference - local = ref_minus_local_ns +- error_ns."""
    local_ns: int
    ref_minus_local_ns: int
    error_ns: int
    server: str
