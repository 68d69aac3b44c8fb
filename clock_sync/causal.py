"""Refinement from the trace's own causality, per node model and globally.

Input: the nodes' models and facts "event a (node A, local time ta) happens before event
b (node B, local time tb)": a send before its receive ends, an RPC server inside its
client, every participant's entry into an N x N collective before anyone leaves it.
On the reference timeline, ta - offA(ta) <= tb - offB(tb), so

  1. (tighten, sound) each fact cuts the other node's polygon: offB(tb) <= tb - ta +
     maxA(ta) and offA(ta) >= minB(tb) - (tb - ta). Applied to every segment until
     nothing shrinks, it narrows the interval of every node, also through chains of
     nodes (Scalasca's controlled logical clock does this per event; here it moves whole
     models). A cut that would leave no line means the sources contradict the trace:
     it is not applied and the node is flagged.
  2. (estimate, zero violations) the centres of the tightened polygons may still break
     a few facts. Each node's estimate is moved by a piecewise-linear correction: knots
     every KNOT_NS near its facts, continuous, changing no faster than a clock can drift (so it keeps
     the node's own order of events). A fact then reads x_b - x_a <= gap for the knots
     around its two events: a system of difference constraints, solved exactly by
     shortest paths (Bellman-Ford). Of its solutions the one nearest zero is taken: each
     knot moves no more than the facts force, and within the node's bounds where the
     bounds allow. Facts that no correction can satisfy are returned as violations: a
     clock inconsistency.
"""
import dataclasses

import numpy as np

from . import geometry
from .fit import MAX_DRIFT_PPM, centre
from .model import ClockModel

ROUNDS = 8              # tightening passes; each one lets a cut travel one node further
BEYOND_BOUND = "corrected_beyond_bound"   # a model the correction moved outside its bounds
MARGIN_NS = 1           # aligned times are rounded to ns: keep this much slack
KNOT_NS = 1 * 10**9     # spacing of the correction's knots
# The correction may change no faster than a clock can drift, so it never reorders a
# node's own events nor stretches a span by more than that.
MAX_STEP_NS = MAX_DRIFT_PPM * 1e-6 * KNOT_NS
_FAR = 1e15             # stands for "no bound" in the shortest-path arithmetic


@dataclasses.dataclass(frozen=True)
class Precedence:
    """Fact i: event (node_a[i], t_a[i]) happens before event (node_b[i], t_b[i])."""
    node_a: np.ndarray  # int index into the model list
    t_a: np.ndarray     # int64 local ns on node_a's clock
    node_b: np.ndarray
    t_b: np.ndarray

    def __len__(self) -> int:
        return len(self.t_a)


@dataclasses.dataclass(frozen=True)
class Refinement:
    models: list[ClockModel]
    violations: np.ndarray      # indices of facts still broken


def gaps(models: list[ClockModel], facts: Precedence) -> np.ndarray:
    """Aligned time of b minus aligned time of a, per fact (negative: broken)."""
    ref_a = _aligned(models, facts.node_a, facts.t_a)
    ref_b = _aligned(models, facts.node_b, facts.t_b)
    return ref_b - ref_a


def violations(models: list[ClockModel], facts: Precedence) -> np.ndarray:
    return np.flatnonzero(gaps(models, facts) < 0)


def _evaluate(models, node, t):
    """(estimate, lo, hi) of each event's node model at its local time. Events are grouped
    by node with one sort (a mask per node cost nodes x facts: 4.3 of 5.7 s at 256 ranks)."""
    est, lo, hi = np.zeros(len(t)), np.full(len(t), -np.inf), np.full(len(t), np.inf)
    node = np.asarray(node)
    order = np.argsort(node.astype(np.uint16) if len(models) <= 1 << 16 else node, kind="stable")  # radix
    for rows in np.split(order, np.flatnonzero(np.diff(node[order])) + 1):
        if len(rows):
            est[rows], lo[rows], hi[rows] = models[int(node[rows[0]])].evaluate(t[rows])
    return est, lo, hi


def _aligned(models, node, t) -> np.ndarray:
    return np.asarray(t, dtype=np.int64) - np.rint(_evaluate(models, node, t)[0]).astype(np.int64)


def _bounds(models, node, t):
    return _evaluate(models, node, t)[1:]


def reference_window(models, node, t) -> tuple[np.ndarray, np.ndarray]:
    """(earliest, latest) reference time of each event: its local time less the largest
    and the smallest offset its node's model allows."""
    lo, hi = _bounds(models, node, t)
    return t - hi, t - lo


def may_bind(latest_a, earliest_b) -> np.ndarray:
    """Whether "a before b" could be broken by lines the models allow, given a's latest and
    b's earliest reference time (or by less than the margin the correction keeps). A fact
    that cannot hold whatever tightening does: most facts of a collective on clocks bounded
    to microseconds (a start before an end milliseconds later)."""
    return ~(earliest_b - latest_a > MARGIN_NS)


def refine(models: list[ClockModel], facts: Precedence) -> Refinement:
    """Tighten and correct the models by the facts that may bind (_may_bind); where the
    correction, which interpolates between the facts' times, breaks one set aside, again
    with that one too. Violations are counted over every fact."""
    refined, binding = list(models), _may_bind(models, facts)
    while binding.any():
        some = Precedence(facts.node_a[binding], facts.t_a[binding], facts.node_b[binding], facts.t_b[binding])
        refined = _correct(_tighten(list(models), some), some)
        broken = gaps(refined, facts) < 0
        if not (broken & ~binding).any():
            break
        binding |= broken
    return Refinement(refined, violations(refined, facts))


def _may_bind(models: list[ClockModel], facts: Precedence) -> np.ndarray:
    """may_bind per fact. The others, at 64 ranks, made 8 rounds of tightening and the
    correction's graph take 7.9 s and 1.2 GB per 200k spans; 1.8 s and 360 MB without them."""
    if not len(facts):
        return np.zeros(0, dtype=bool)
    return may_bind(reference_window(models, facts.node_a, facts.t_a)[1],
                    reference_window(models, facts.node_b, facts.t_b)[0])


# -- step 1: sound tightening ------------------------------------------------------------------

def _tighten(models: list[ClockModel], facts: Precedence) -> list[ClockModel]:
    conflicts: set[int] = set()
    dt = (facts.t_b - facts.t_a).astype(np.float64)
    for _ in range(ROUNDS):
        lo_a, hi_a = _bounds(models, facts.node_a, facts.t_a)
        lo_b, hi_b = _bounds(models, facts.node_b, facts.t_b)
        cuts = ((facts.node_b, facts.t_b, dt + hi_a, True),     # offB(tb) <= dt + maxA(ta)
                (facts.node_a, facts.t_a, lo_b - dt, False))    # offA(ta) >= minB(tb) - dt
        changed = False
        for node, t, value, upper in cuts:
            usable = np.isfinite(value)
            for k in np.unique(node[usable]).tolist():
                rows = usable & (node == k)
                new, moved = _cut(models[k], t[rows], value[rows], upper)
                if new is None:
                    conflicts.add(k)
                elif moved:
                    models[k] = new
                    changed = True
        if not changed:
            break
    for k in conflicts:
        models[k] = models[k].with_flags("causality_conflict")
    return models


def _cut(model: ClockModel, t: np.ndarray, value: np.ndarray, upper: bool):
    """The model with its segments cut by offset(t) <= value (or >=); None on a conflict.
    Times in a transition between segments cut nothing: which line holds there is unknown."""
    segments = list(model.segments)
    owner = model.segment_of(t)
    moved = False
    for i, seg in enumerate(segments):
        mine = owner == i
        if seg.bridge or not mine.any():  # a bridge's truth is not one line: cutting it is unsound
            continue
        poly = geometry.clip_all(seg.polygon, (t[mine] - seg.t0) / 1e9, value[mine], upper)
        if not len(poly):
            return None, False
        if len(poly) != len(seg.polygon) or not np.allclose(poly, seg.polygon, rtol=0, atol=0.5):
            a, b = centre(poly)
            segments[i] = dataclasses.replace(seg, polygon=poly, a=a, b=b)
            moved = True
    return dataclasses.replace(model, segments=tuple(segments)), moved


# -- step 2: a correction that leaves no violation -------------------------------------------------

def _correct(models: list[ClockModel], facts: Precedence) -> list[ClockModel]:
    knots = _Knots(facts, len(models))
    gap = gaps(models, facts).astype(np.float64) - MARGIN_NS
    # x_vb - x_va <= gap for every pair of knots around a and b (then it holds for any
    # interpolation between them).
    src, dst, weight = [], [], []
    for va in knots.around(facts.node_a, facts.t_a):
        for vb in knots.around(facts.node_b, facts.t_b):
            ok = (va >= 0) & (vb >= 0)
            src.append(va[ok])
            dst.append(vb[ok])
            weight.append(gap[ok])
    neighbours, steps = knots.neighbours()
    src += [neighbours[:, 0], neighbours[:, 1]]
    dst += [neighbours[:, 1], neighbours[:, 0]]
    weight += [MAX_STEP_NS * steps] * 2
    src, dst, weight = _tightest(np.concatenate(src), np.concatenate(dst), np.concatenate(weight), knots.n)
    lower, upper = knots.bounds(models, facts)
    x, flag = _nearest_zero(knots.n, src, dst, weight, lower, upper), None
    if x is None:   # the bounds themselves contradict the trace
        x, flag = _nearest_zero(knots.n, src, dst, weight, np.full(knots.n, -_FAR), np.full(knots.n, _FAR)), \
            BEYOND_BOUND
    if x is None:   # the facts contradict each other: no clock can fix that
        return [m.with_flags("causality_cycle") for m in models]
    out = []
    for k, model in enumerate(models):
        first, last = knots.first[k], knots.first[k + 1]
        if last > first and np.any(x[first:last]):
            model = model.corrected(knots.times[first:last], x[first:last])
            if flag and np.any((x[first:last] < lower[first:last]) | (x[first:last] > upper[first:last])):
                model = model.with_flags(flag)
        out.append(model)
    return out


class _Knots:
    """Knots of each node's correction, numbered node after node, on a KNOT_NS grid from its
    first fact: the two around each fact and DECAY_KNOTS on either side within its facts,
    where a correction can return to zero; none in the long stretches between, where it
    runs straight. Every
    knot on the grid made two facts 8 h apart cost 11.5 s (Bellman-Ford takes a round per
    knot of a chain), 24 h apart 114 s. Every model gets a slot, an empty one for a node in
    no fact (one outside the job)."""

    def __init__(self, facts: Precedence, n_nodes: int):
        nodes = np.concatenate([facts.node_a, facts.node_b])
        times = np.concatenate([facts.t_a, facts.t_b])
        self.start = np.zeros(n_nodes, dtype=np.int64)
        cells = [np.empty(0, np.int64)] * n_nodes
        for k in np.unique(nodes).tolist():
            tk = times[nodes == k]
            self.start[k] = tk.min()
            cells[k] = _spread((tk - self.start[k]) // KNOT_NS)
        counts = np.array([len(c) for c in cells], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(counts)])
        self.n = int(self.first[-1])
        self.cell = np.concatenate(cells) if self.n else np.empty(0, np.int64)
        self.node = np.repeat(np.arange(n_nodes), counts)
        self.times = self.start[self.node] + self.cell * KNOT_NS
        self._key = self.node * (1 << 34) + self.cell   # sorted: nodes in order, cells within

    def neighbours(self) -> tuple[np.ndarray, np.ndarray]:
        """(k, 2) pairs of consecutive knots of the same node, and how many grid steps apart."""
        left = np.setdiff1d(np.arange(self.n - 1), self.first[1:] - 1)
        return np.stack([left, left + 1], axis=1), self.cell[left + 1] - self.cell[left]

    def position(self, node, t):
        """(left knot, weight of the right knot) of each event."""
        rel = t - self.start[node]
        return np.searchsorted(self._key, node * (1 << 34) + rel // KNOT_NS), (rel % KNOT_NS) / KNOT_NS

    def around(self, node, t):
        """The knots an event's correction interpolates between (-1: weight zero)."""
        left, w = self.position(node, t)
        return left, np.where(w > 0, left + 1, -1)

    def bounds(self, models, facts):
        """Per knot, how far it may move the estimate: within every interval it touches."""
        lower, upper = np.full(self.n, -_FAR), np.full(self.n, _FAR)
        for node, t in ((facts.node_a, facts.t_a), (facts.node_b, facts.t_b)):
            est, lo, hi = _evaluate(models, node, t)
            for v in self.around(node, t):
                ok = v >= 0
                np.maximum.at(lower, v[ok], np.maximum(lo - est, -_FAR)[ok])
                np.minimum.at(upper, v[ok], np.minimum(hi - est, _FAR)[ok])
        return lower, upper


DECAY_KNOTS = 64   # grid steps kept on each side of a fact: a 64 ms correction decays to zero there


def _spread(cells: np.ndarray) -> np.ndarray:
    """The sorted grid cells within DECAY_KNOTS of a fact's (and the one after it), between
    the first fact's and the one after the last: beyond them the correction stays as it
    is at the ends, as with a knot in every cell, which facts a few seconds apart still get."""
    cells = np.unique(cells)
    lo, hi = np.maximum(cells - DECAY_KNOTS, 0), np.minimum(cells + 1 + DECAY_KNOTS, cells[-1] + 1)
    reach = np.maximum.accumulate(hi)
    new = np.r_[True, lo[1:] > reach[:-1] + 1]            # runs of overlapping ranges
    starts, ends = lo[new], reach[np.r_[new[1:], True]]
    lengths = ends - starts + 1
    return np.repeat(starts - np.r_[0, np.cumsum(lengths)[:-1]], lengths) + np.arange(lengths.sum())


def _tightest(src, dst, weight, n):
    """One constraint per knot pair: the smallest weight."""
    key = src * n + dst
    order = np.lexsort((weight, key))
    first = order[np.r_[True, key[order][1:] != key[order][:-1]]] if len(order) else order
    return src[first], dst[first], weight[first]


def _nearest_zero(n, src, dst, weight, lower, upper):
    """Solution of x_dst - x_src <= weight, lower <= x <= upper, with each x as near zero as
    the others allow; None if there is none. The solutions of difference constraints form
    a lattice: the least one comes from shortest paths into a fixed zero node, and the
    greatest one below max(0, least) from shortest paths out of it."""
    zero = n
    # x_v <= upper_v: edge zero -> v; x_v >= lower_v: edge v -> zero of weight -lower_v.
    s = np.concatenate([src, np.full(n, zero), np.arange(n)])
    d = np.concatenate([dst, np.arange(n), np.full(n, zero)])
    w = np.concatenate([weight, upper, -lower])
    into_zero = _bellman_ford(n + 1, d, s, w, zero)        # reversed graph: paths v -> zero
    if into_zero is None:
        return None
    least = -into_zero[:n]
    cap = np.maximum(0.0, least)
    w_cap = np.concatenate([weight, cap, -lower])
    out_of_zero = _bellman_ford(n + 1, s, d, w_cap, zero)
    return None if out_of_zero is None else out_of_zero[:n]


def _bellman_ford(n, src, dst, weight, start):
    """Shortest distances from `start`, vectorised over edges; None on a negative cycle."""
    dist = np.full(n, np.inf)
    dist[start] = 0.0
    for _ in range(n + 1):
        relaxed = dist.copy()
        np.minimum.at(relaxed, dst, dist[src] + weight)
        if np.array_equal(relaxed, dist):
            return dist
        dist = relaxed
    return None
