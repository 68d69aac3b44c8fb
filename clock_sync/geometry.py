"""Convex polygons of clock lines.

A clock line is offset(t) = a + b * u with u = (t - t0) / 1e9, t in local ns: `a` is the
offset (ns) at t0 and `b` the drift in ns per second (ppm * 1000). Every bound
"offset(t) >= v" or "offset(t) <= v" is a half-plane in (a, b), so the lines that agree
with a set of bounds form a convex polygon (the linear-programming view of Duda et al.
1987 and Moon, Skelly and Towsley 1999); its vertices give, at any time, the exact
interval of offsets those bounds allow. Polygons are (V, 2) float arrays, counter-
clockwise; EMPTY has no vertices.
"""
import numpy as np

EMPTY = np.empty((0, 2))

# Bounds are integer ns; a polygon that misses a bound by less than this still holds it.
TOLERANCE_NS = 0.5


def box(a_lo: float, a_hi: float, b_max: float) -> np.ndarray:
    return np.array([[a_lo, -b_max], [a_hi, -b_max], [a_hi, b_max], [a_lo, b_max]], dtype=np.float64)


def clip(poly: np.ndarray, u: float, v: float, upper: bool) -> np.ndarray:
    """The part of `poly` where a + b*u <= v (upper) or >= v (lower); EMPTY if none."""
    return _clip(poly, 1.0, u, v) if upper else _clip(poly, -1.0, -u, -v)


def clip_drift(poly: np.ndarray, b_max: float) -> np.ndarray:
    """The part of `poly` where |b| <= b_max."""
    return _clip(_clip(poly, 0.0, 1.0, b_max), 0.0, -1.0, b_max)


def _clip(poly: np.ndarray, p: float, q: float, r: float) -> np.ndarray:
    """Keep p*a + q*b <= r: Sutherland-Hodgman against one half-plane, which keeps a
    convex polygon convex."""
    if not len(poly):
        return poly
    s = p * poly[:, 0] + q * poly[:, 1] - r
    inside = s <= TOLERANCE_NS
    if inside.all():
        return poly
    if not inside.any():
        return EMPTY
    out = []
    n = len(poly)
    for i in range(n):
        j = (i + 1) % n
        if inside[i]:
            out.append(poly[i])
        if inside[i] != inside[j]:
            f = s[i] / (s[i] - s[j])
            out.append(poly[i] + f * (poly[j] - poly[i]))
    return np.array(out)


# Above this many bounds, clip_all keeps the tightest per time bin before taking the hull.
MAX_BOUNDS = 4096


def clip_all(poly: np.ndarray, u: np.ndarray, v: np.ndarray, upper: bool) -> np.ndarray:
    """Clip by many bounds of one direction; only those on the hull of the points (u, v)
    can cut, so the others are skipped. Very many bounds are first thinned to the
    tightest of each time bin: a subset of true bounds, so the result stays sound."""
    if len(u) > MAX_BOUNDS:
        u, v = _thin(u, v, upper)
    for k in _hull_indices(u, v, lower_hull=upper):
        poly = clip(poly, u[k], v[k], upper)
        if not len(poly):
            break
    return poly


def _thin(u: np.ndarray, v: np.ndarray, upper: bool):
    bins = MAX_BOUNDS // 2
    edges = np.linspace(u.min(), u.max(), bins + 1)
    which = np.clip(np.searchsorted(edges, u, side="right") - 1, 0, bins - 1)
    order = np.lexsort((v if upper else -v, which))
    first = order[np.r_[True, which[order][1:] != which[order][:-1]]]
    return u[first], v[first]


def _hull_indices(u: np.ndarray, v: np.ndarray, lower_hull: bool) -> list[int]:
    """Indices of the lower (or upper) convex hull of the points, by Andrew's monotone chain.
    A line below all points only has to pass below the lower hull's vertices."""
    if len(u) <= 2:
        return list(range(len(u)))
    order = np.lexsort((v, u) if lower_hull else (-v, u))
    sign = 1.0 if lower_hull else -1.0
    hull: list[int] = []
    for k in order.tolist():
        while len(hull) >= 2:
            i, j = hull[-2], hull[-1]
            cross = (u[j] - u[i]) * (v[k] - v[i]) - (v[j] - v[i]) * (u[k] - u[i])
            if sign * cross <= 0:
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def hull(points: np.ndarray) -> np.ndarray:
    """Convex hull of (a, b) points, counter-clockwise (Andrew's monotone chain): the
    smallest polygon with the same extent at every time as the union of those lines."""
    pts = np.unique(points, axis=0)    # sorted by a, then b
    if len(pts) <= 2:
        return pts

    def chain(seq) -> list:
        out: list = []
        for p in seq:
            while len(out) >= 2 and ((out[-1][0] - out[-2][0]) * (p[1] - out[-2][1])
                                     - (out[-1][1] - out[-2][1]) * (p[0] - out[-2][0])) <= 0:
                out.pop()
            out.append(p)
        return out

    ring = chain(pts)[:-1] + chain(pts[::-1])[:-1]
    return np.array(ring)


def extent(poly: np.ndarray, u) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) of a + b*u over the polygon, for each u."""
    u = np.asarray(u, dtype=np.float64)
    values = poly[:, 0][:, None] + poly[:, 1][:, None] * u.reshape(1, -1)
    return values.min(axis=0).reshape(u.shape), values.max(axis=0).reshape(u.shape)


def centroid(poly: np.ndarray) -> tuple[float, float]:
    """Area centroid; the vertex mean for a degenerate (flat) polygon. Affine-equivariant,
    so it does not depend on the choice of t0 or of units. Computed about the first vertex:
    an offset of hours (monotonic clocks differ by their machines' uptimes) times a drift
    left the cross products' few-us differences to cancellation, off by up to seconds."""
    origin = poly[0]
    a, b = poly[:, 0] - origin[0], poly[:, 1] - origin[1]
    a2, b2 = np.roll(a, -1), np.roll(b, -1)
    cross = a * b2 - a2 * b
    area = cross.sum() / 2
    scale = np.ptp(a) * np.ptp(b)
    if abs(area) <= 1e-9 * scale or scale == 0:
        return float(origin[0] + a.mean()), float(origin[1] + b.mean())
    return (float(origin[0] + ((a + a2) * cross).sum() / (6 * area)),
            float(origin[1] + ((b + b2) * cross).sum() / (6 * area)))


def shift(poly: np.ndarray, du: float) -> np.ndarray:
    """The same lines with their origin moved by du seconds: a' = a + b*du."""
    out = poly.copy()
    out[:, 0] += poly[:, 1] * du
    return out
