"""Two-way exchanges (t1 local send, t2 reference receive, t3 reference send, t4 local
receive) as bounds on a node's offset, and a simple offset/drift fit from them."""
import numpy as np

from .model import ClockModel, unknown


def offset_bounds(t1, t2, t3, t4):
    """Interval [lo, hi] that must contain offset = local - reference, whatever the path
    asymmetry: the request cannot arrive before it was sent (lo = t1 - t2), nor the
    reply (hi = t4 - t3). Its width is the exchange's round-trip delay."""
    t1, t2, t3, t4 = (np.asarray(t, dtype=np.int64) for t in (t1, t2, t3, t4))
    return t1 - t2, t4 - t3


def fit_min_delay(local, lo, hi, source: str = "exchange") -> ClockModel:
    """Least-squares line through the midpoints of the lowest-delay quarter of the samples
    (NTP's clock filter idea); the bound covers the residuals and the half-width."""
    local, lo, hi = (np.asarray(a, dtype=np.float64) for a in (local, lo, hi))
    n = len(local)
    if n == 0:
        return unknown()
    delay = hi - lo
    keep = delay <= np.quantile(delay, 0.25) if n >= 8 else np.ones(n, dtype=bool)
    t, mid, half = local[keep], (lo[keep] + hi[keep]) / 2, delay[keep] / 2
    at = int(t.mean())
    if len(t) >= 2 and np.ptp(t) > 1e9:
        slope, intercept = np.polyfit(t - at, mid, 1)
    else:
        slope, intercept = 0.0, float(np.median(mid))
    residual = np.abs(mid - (intercept + slope * (t - at)))
    return ClockModel(offset_ns=float(intercept), drift_ppm=float(slope * 1e6), at_ns=at,
                      error_ns=float((residual + half).max()), samples=n, sources=(source,))
