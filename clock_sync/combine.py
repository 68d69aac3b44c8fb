"""Several sources for one node: select the ones that agree, intersect them; compose
offsets along a path of clocks.

Selection is NTP's: at a spread of times, Marzullo's algorithm finds the largest group of
sources whose intervals overlap; a source outside it is a falseticker, flagged and not
trusted (a tie goes to the group with the tighter bounds). The sources that remain are
fitted together: their bounds are all hard, so the joint polygon is the intersection of
theirs, and the tightest source dominates the estimate where it has samples.

Composition: bounds on (node - peer) plus a model of (peer - reference) give bounds on
(node - reference); the peer's interval is added, so errors add up along a path such as
edge -> gateway -> cloud collector.
"""
import dataclasses

import numpy as np

from .exchange import Bounds, concat
from .fit import fit
from .model import ClockModel, unknown

SELECTION_TIMES = 256   # evaluation times spread over the sources' samples


def combine(sources: dict[str, Bounds], **fit_options) -> ClockModel:
    sources = {name: b for name, b in sources.items() if len(b)}
    if not sources:
        return unknown()
    models = {name: fit(b, name, **fit_options) for name, b in sources.items()}
    if len(models) == 1:
        return next(iter(models.values()))
    rejected = falsetickers(models, concat(list(sources.values())).t)
    kept = [name for name in models if name not in rejected]
    joint = fit(concat([sources[name] for name in kept]), **fit_options)
    flags = joint.flags + tuple(f"falseticker:{name}" for name in rejected)
    return dataclasses.replace(joint, sources=tuple(kept), flags=flags,
                               samples=sum(len(b) for b in sources.values()))


def falsetickers(models: dict[str, ClockModel], times: np.ndarray) -> set[str]:
    """Sources that are outside the agreeing majority at any of the evaluation times."""
    names = list(models)
    times = np.unique(times)
    if len(times) > SELECTION_TIMES:
        times = times[np.linspace(0, len(times) - 1, SELECTION_TIMES).astype(int)]
    lo, hi = map(np.stack, zip(*(models[n].bounds_at(times) for n in names)))
    bad: set[str] = set()
    for col in range(len(times)):
        members = marzullo(lo[:, col], hi[:, col])
        bad.update(names[i] for i in range(len(names)) if i not in members)
    return bad


def marzullo(lo: np.ndarray, hi: np.ndarray) -> set[int]:
    """Indices of the largest set of intervals with a common point; among equally large
    sets, the one whose members have the tightest intervals (weight 1 / width^2)."""
    weight = 1.0 / np.maximum(hi - lo, 1.0) ** 2
    best, best_key = set(), (-1, -1.0)
    for point in np.concatenate([lo, hi]):
        members = np.flatnonzero((lo <= point) & (point <= hi))
        key = (len(members), float(weight[members].sum()))
        if key > best_key:
            best, best_key = set(members.tolist()), key
    return best


def compose(bounds: Bounds, link: ClockModel) -> Bounds:
    """Bounds on (node - peer) made into bounds on (node - reference) through a model of
    (peer - reference) in the peer's time: the peer's interval is added to each sample."""
    peer_t = bounds.t - np.rint(bounds.mid).astype(np.int64)
    lo, hi = link.bounds_at(peer_t)
    out = bounds.widened(lo, hi)
    finite = np.isfinite(out.lo) & np.isfinite(out.hi)
    return out.take(finite)
