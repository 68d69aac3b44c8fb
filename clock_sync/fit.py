"""Offset and drift from bounds: the convex-hull / linear-programming fit, piecewise.

Every sample is a pair of half-planes on the lines offset(t) = a + b*t (geometry); the
lines that satisfy all of a stretch of samples form a polygon, whose centre is the
estimate and whose extent at any time is the error bound (Duda et al. 1987; Moon, Skelly
and Towsley 1999). Samples are taken in time order. When the next one leaves no line, the
clock stepped or its drift changed somewhere after the last sample that fits the new
line's samples too: the samples before that point make one segment, the samples from
the failing one on start the next, and the ambiguous ones in between form a bridge whose
bound also covers both neighbours' lines (the truth is one of them). A lone sample that
contradicts both its past and the next few samples is an outlier and is dropped.
Segments are also cut at `window_ns`, so that slow wander of the drift cannot bend one
line across hours.
"""
import numpy as np

from . import geometry
from .exchange import Bounds, valid
from .model import ClockModel, Segment, unknown

# The one table of tuning choices for fitting.
MAX_DRIFT_PPM = 1000.0          # prior on |drift| for the bounds: crystals ~100 ppm, slewing daemons 500
TYPICAL_DRIFT_PPM = 200.0       # prior for the estimate alone, where the samples leave the drift open
WINDOW_NS = 300 * 10**9         # longest stretch one line is fitted over
OUTLIER_LOOKAHEAD = 3           # a sample is an outlier if this many later ones agree without it


def fit(bounds: Bounds, source: str = "", max_drift_ppm: float = MAX_DRIFT_PPM,
        window_ns: int = WINDOW_NS) -> ClockModel:
    n_all = len(bounds)
    bounds = bounds.take(valid(bounds, max_drift_ppm)).sorted()
    n = len(bounds)
    if not n:
        return unknown(n_all, (f"invalid_samples:{n_all}",) if n_all else ("no_samples",))
    fitter = _Fitter(bounds, max_drift_ppm * 1000)
    t = bounds.t
    pieces: list[tuple[int, int, bool]] = []    # (first, end, is_bridge) index ranges
    outliers = steps = 0
    start, poly, k = 0, fitter.polygon(0, 1), 1
    while k < n:
        if t[k] - t[start] > window_ns:
            # A new line from the last half window on; sample k is then added as any other,
            # so that one that contradicts them is still found to be a step or an outlier.
            pieces.append((start, k, False))
            start = min(int(np.searchsorted(t, t[k] - window_ns // 2)), k)
            poly = fitter.polygon(start, k) if start < k else fitter.polygon(k, k + 1)
            k += start == k
            continue
        nxt = fitter.add(poly, k)
        if len(nxt):
            poly, k = nxt, k + 1
            continue
        ahead = min(n, k + 1 + OUTLIER_LOOKAHEAD)
        if ahead > k + 1 and len(fitter.add_range(poly, k + 1, ahead)):
            outliers += 1
            fitter.drop(k)
            k += 1
            continue
        steps += 1
        first_after = fitter.reach_back(start, k)
        pieces.append((start, first_after, False))
        if first_after < k:
            pieces.append((first_after, k, True))
        start, poly, k = k, fitter.polygon(k, k + 1), k + 1
    pieces.append((start, n, False))
    segments = fitter.segments(pieces)
    flags = []
    if outliers:
        flags.append(f"outliers:{outliers}")
    if steps:   # the clock stepped, or its drift changed: where no one line fits both sides
        flags.append(f"steps:{steps}")
    if n < n_all:
        flags.append(f"invalid_samples:{n_all - n}")
    if len(segments) > 1:
        flags.append(f"segments:{len(segments)}")
    return ClockModel(tuple(segments), n_all, (source,) if source else (), tuple(flags))


def centre(poly):
    """The estimate in a polygon of lines: its centroid, taken among the lines of typical
    drift when there are any (a few samples close together leave the drift to the prior,
    and the bounds must allow the extreme one, but the estimate should not lean on it)."""
    typical = geometry.clip_drift(poly, TYPICAL_DRIFT_PPM * 1000)
    return geometry.centroid(typical if len(typical) else poly)


class _Fitter:
    """Polygons over index ranges of time-sorted bounds, in seconds since the first sample."""

    def __init__(self, bounds: Bounds, b_max: float):
        self.b = bounds
        self.origin = int(bounds.t[0])
        self.u_lo = (bounds.lo_t - self.origin) / 1e9
        self.u_hi = (bounds.hi_t - self.origin) / 1e9
        self.b_max = b_max
        self.dropped = np.zeros(len(bounds), dtype=bool)

    def drop(self, k: int) -> None:
        self.dropped[k] = True

    def add(self, poly: np.ndarray, k: int) -> np.ndarray:
        poly = geometry.clip(poly, self.u_lo[k], self.b.lo[k], upper=False)
        return geometry.clip(poly, self.u_hi[k], self.b.hi[k], upper=True)

    def add_range(self, poly: np.ndarray, i: int, j: int) -> np.ndarray:
        keep = np.flatnonzero(~self.dropped[i:j]) + i
        poly = geometry.clip_all(poly, self.u_lo[keep], self.b.lo[keep], upper=False)
        return geometry.clip_all(poly, self.u_hi[keep], self.b.hi[keep], upper=True)

    def polygon(self, i: int, j: int) -> np.ndarray:
        """Lines allowed by samples i..j-1 and the drift prior (never empty for one sample)."""
        u = self.u_lo[i]
        spread = self.b_max * (abs(u) + 1.0)
        start = geometry.box(self.b.lo[i] - spread, self.b.hi[i] + spread, self.b_max)
        return self.add_range(start, i, j)

    def reach_back(self, start: int, k: int) -> int:
        """Earliest index after `start` from which samples up to k still fit one line."""
        poly = self.polygon(k, k + 1)
        j = k
        while j - 1 > start:
            if self.dropped[j - 1]:
                j -= 1
                continue
            nxt = self.add(poly, j - 1)
            if not len(nxt):
                break
            poly = nxt
            j -= 1
        return j

    def segments(self, pieces: list[tuple[int, int, bool]]) -> list[Segment]:
        """One Segment per piece, centred on the middle of its samples' time range."""
        t = self.b.t
        out = []
        polys = [self.polygon(i, j) for i, j, _ in pieces]
        for n, (i, j, bridge) in enumerate(pieces):
            first, last = int(t[i]), int(t[j - 1])
            t0 = first + (last - first) // 2
            du = (t0 - self.origin) / 1e9
            poly = geometry.shift(polys[n], du)
            a, b = centre(poly)
            if bridge:  # its bound is the union with both neighbours' lines
                poly = geometry.hull(np.concatenate(
                    [poly, geometry.shift(polys[n - 1], du), geometry.shift(polys[n + 1], du)]))
            out.append(Segment(first, last, t0, a, b, poly, int((~self.dropped[i:j]).sum()), bridge))
        return out
