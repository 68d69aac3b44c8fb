"""Latency budgets: limits on spans or attribution categories, checked across traces.

A budget file is TOML; each [[budget]] table is one limit:

    [[budget]]                    # edge.preprocess p99 <= 5ms
    span = "preprocess"           # spans of this name (a glob) ...
    node = "edge*"                # ... on nodes whose node id or role matches (glob; optional)
    percentile = 99
    max = "5ms"

    [[budget]]                    # network.uplink p95 <= 20ms
    category = "network.uplink"   # one of the attribution categories (DESIGN.md)
    percentile = 95
    max = "20ms"

    [[budget]]                    # collective.wait <= 10% of step
    category = "collective.wait"
    traces = "*step"              # only traces whose name matches (a glob; default: all)
    max = "10%"                   # a share of each trace's duration (per rank: of its window)

    [[budget]]                    # the whole request p99 <= 120ms
    traces = "request"
    percentile = 99
    max = "120ms"

Keys: `max` (required): a time ("800ns", "250us", "5ms", "1.5s", "2min": collector/durations.py) or a share of the trace
("10%"; with "worst_rank" or "mean_rank", a share of each rank's window in the trace, as the
report's per-rank breakdown and bubble fraction have it). `percentile` (default 100, i.e. every sample must hold; the value reported is the
nearest-rank percentile: the smallest sample with at least that share of the samples at or
below it, never an interpolation; p99 of 100 samples is the second largest). `name` (optional label).
What is measured, one sample each:
  - `span`: every matching span, its duration on the aligned timeline;
  - `category`: every trace that can have that time (one with RPCs for network.*, with
    collectives for collective.*, sends or receives for p2p.*, a pipeline for bubble, compute
    or data spans for those; any for host.overhead and clock.uncertainty: a training step's
    0 of uplink would say nothing of the link), the time in it; `measure` says where:
    "critical_path" (the default), "worst_rank" or "mean_rank" (the per-rank breakdown).
    collective.wait, p2p.wait and bubble default to "worst_rank": by construction, waiting
    is never on the critical path (the path runs through whoever was late), and
    collective.wait or p2p.wait measured there is refused;
  - neither: every trace, its duration.
A budget that matches no span or trace fails, so that a typo cannot pass a CI gate.
"""
import dataclasses
import fnmatch
import math
import re
import tomllib
from fractions import Fraction

import numpy as np

from .attribution import CATEGORIES, OFF_PATH, SOURCE_KINDS, WAITING, Attribution
from .durations import format_ns, parse_ns
from .spantable import SpanTable

MEASURES = ("critical_path", "worst_rank", "mean_rank")
_KEYS = {"name", "span", "node", "category", "traces", "measure", "percentile", "max"}
_SHARE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


class BudgetError(ValueError):
    """A budget file that cannot be used, with where and why."""


@dataclasses.dataclass(frozen=True)
class Budget:
    name: str
    limit: float            # ns, or a fraction of the trace when `share`
    share: bool
    percentile: float
    span: str | None = None
    node: str | None = None
    category: str | None = None
    traces: str | None = None
    measure: str = "critical_path"

    @property
    def rule(self) -> str:
        what = self.span if self.span else self.category or "duration"
        if self.span and self.node:
            what = f"{self.node}.{what}"
        p = "" if self.percentile == 100 else f" p{self.percentile:g}"
        limit = f"{self.limit * 100:.12g}%" if self.share else format_ns(self.limit, 12, sep="")   # as a budget file has it
        scope = f" of {self.traces}" if self.traces and self.share else (f" in {self.traces}" if self.traces else "")
        how = f" ({self.measure})" if self.category and self.measure != "critical_path" else ""
        return f"{what}{p} <= {limit}{scope}{how}"


def parse_limit(text) -> tuple[float, bool]:
    """("5ms" -> (5e6, False)), ("10%" -> (0.1, True))."""
    if isinstance(text, str):
        if (ns := parse_ns(text)) is not None:
            return ns, False
        if m := _SHARE.match(text):
            if float(m.group(1)) > 100:
                raise ValueError(f"max = {text!r}: a share of the trace is at most 100%")
            return float(m.group(1)) / 100, True
    raise ValueError(f"max = {text!r}: expected a time like \"5ms\", \"250us\", \"1.5s\" or a share like \"10%\"")


def parse(doc: dict, source: str = "budget file") -> list[Budget]:
    entries = doc.get("budget")
    unknown = set(doc) - {"budget"}
    if unknown or not isinstance(entries, list) or not entries:
        raise BudgetError(f"{source}: expected one or more [[budget]] tables"
                          + (f" (unknown top-level keys: {', '.join(sorted(unknown))})" if unknown else ""))
    out = []
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise BudgetError(f"{source}: budget #{i} is {entry!r}, not a [[budget]] table")
        where = f"{source}: budget #{i}" + (f" ({entry['name']})" if isinstance(entry.get("name"), str) else "")
        try:
            out.append(_one(entry))
        except (ValueError, TypeError) as exc:
            raise BudgetError(f"{where}: {exc}") from None
    return out


def _one(entry: dict) -> Budget:
    unknown = set(entry) - _KEYS
    if unknown:
        raise ValueError(f"unknown keys {', '.join(sorted(unknown))}; known: {', '.join(sorted(_KEYS))}")
    if "max" not in entry:
        raise ValueError("missing max (a time like \"5ms\" or a share like \"10%\")")
    for key in ("name", "span", "node", "category", "traces", "measure"):
        if key in entry and not isinstance(entry[key], str):
            raise ValueError(f"{key} must be a string")
        if key in entry and key != "name" and not entry[key].strip():
            raise ValueError(f"{key} is empty: give a name (or a glob), or leave it out")
    limit, share = parse_limit(entry["max"])
    percentile = entry.get("percentile", 100)
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
        raise ValueError(f"percentile = {percentile!r}: expected a number in (0, 100]")
    span, category = entry.get("span"), entry.get("category")
    if span and category:
        raise ValueError("give span or category, not both")
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"category = {category!r}: expected one of {', '.join(CATEGORIES)}")
    if "node" in entry and not span:
        raise ValueError("node only applies to a span budget")
    measure = entry.get("measure", "worst_rank" if category in WAITING else "critical_path")
    if measure not in MEASURES:
        raise ValueError(f"measure = {measure!r}: expected one of {', '.join(MEASURES)}")
    if "measure" in entry and not category:
        raise ValueError("measure only applies to a category budget")
    if measure == "critical_path" and category in OFF_PATH:
        raise ValueError(f"{category} is never on the critical path, which runs through whoever was late, not "
                         f"who waited for them: measure it per rank (worst_rank or mean_rank)")
    budget = Budget(name="", limit=limit, share=share, percentile=float(percentile), span=span,
                    node=entry.get("node"), category=category, traces=entry.get("traces"), measure=measure)
    return dataclasses.replace(budget, name=entry.get("name") or budget.rule)


def load(path: str) -> list[Budget]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BudgetError(f"{path}: not valid TOML: {exc}") from None
    return parse(doc, path)


def _samples(b: Budget, traces: list[dict], table: SpanTable, at: Attribution) -> tuple[np.ndarray, list[tuple]]:
    """(values, (trace id, node id or None) per value) of one budget: a span's node, or the
    worst rank's, is named, so that its worst samples say whom to ask."""
    chosen = [t for t in traces if b.traces is None or fnmatch.fnmatchcase(t["name"], b.traces)]
    if b.category is not None:
        chosen = _can_have(b.category, chosen, table)
    if b.span is None:
        values, ids = [], []
        for t in chosen:
            duration = t["duration_ns"]
            node = None
            if b.category is None or b.measure == "critical_path":
                value = t["attribution"][b.category] if b.category else duration
                values.append(value / max(duration, 1) if b.share else value)
            else:
                value, node = _per_rank(b, t)
                values.append(value)
            ids.append((t["trace_id"], node))
        return np.asarray(values, dtype=np.float64), ids
    names = np.array([fnmatch.fnmatchcase(n, b.span) for n in table.names], dtype=bool)
    nodes = np.array([b.node is None or fnmatch.fnmatchcase(r.node_id, b.node) or fnmatch.fnmatchcase(r.role, b.node)
                      for r in table.resources], dtype=bool)
    index = {trace_id: i for i, trace_id in enumerate(table.trace_ids)}
    wanted = [index[t["trace_id"]] for t in chosen]   # (a report of some traces holds others, for context)
    rows = np.flatnonzero(names[table.name] & nodes[table.node]) if len(table) else np.empty(0, np.int64)
    rows = rows[np.isin(table.trace[rows], wanted)]
    duration = (at.dag.ends - at.dag.starts)[rows].astype(np.float64)
    if b.share:
        trace = table.trace[rows]
        duration = duration / np.maximum(at.dag.trace_end[trace] - at.dag.trace_start[trace], 1)
    return duration, [(table.trace_ids[tr], table.nodes[node])
                      for tr, node in zip(table.trace[rows].tolist(), table.node[rows].tolist())]


def _can_have(category: str, traces: list[dict], table: SpanTable) -> list[dict]:
    """The traces that can have time in `category` (attribution.SOURCE_KINDS)."""
    if category == "bubble":
        return [t for t in traces if t["pipeline"] is not None]
    kinds = SOURCE_KINDS.get(category)
    if kinds is None:
        return traces
    having = set(table.trace[np.isin(table.kind, kinds)].tolist())
    index = {trace_id: i for i, trace_id in enumerate(table.trace_ids)}
    return [t for t in traces if index[t["trace_id"]] in having]


def _per_rank(b: Budget, trace: dict) -> tuple[float, str | None]:
    """A category on the worst rank (and that rank's node), or on the mean rank, of one
    trace: a share is of each rank's own window (the trace's duration includes time before
    a rank's step began)."""
    values = {node: r["attribution"][b.category] / (max(r["window_ns"], 1) if b.share else 1)
              for node, r in trace["per_rank"].items()}
    if not values:
        return 0, None
    if b.measure == "mean_rank":
        return sum(values.values()) / len(values), None
    worst = max(values, key=values.get)
    return values[worst], worst


def _worst(where: tuple, value) -> dict:
    trace_id, node = where
    return {"trace_id": trace_id, "value": value} if node is None else {"trace_id": trace_id, "node": node,
                                                                         "value": value}


def nearest_rank(values: np.ndarray, percentiles) -> np.ndarray:
    """The nearest-rank percentiles of `values` (along its first axis): the smallest sample
    with at least p % of the samples at or below it, its rank ceil(p n / 100) taken exactly
    from p as written (numpy's float product put p99.9 of 1000 samples at the 1000th)."""
    ordered = np.sort(values, axis=0)
    ranks = [max(1, math.ceil(Fraction(str(p)) * len(ordered) / 100)) for p in percentiles]
    return ordered[np.array(ranks) - 1]


def evaluate(budgets: list[Budget], traces: list[dict], table: SpanTable, at: Attribution, worst: int = 3) -> list[dict]:
    """Each budget with its measured value at its percentile, whether it holds, and the
    traces with the worst samples."""
    out = []
    for b in budgets:
        values, ids = _samples(b, traces, table, at)
        entry = {"name": b.name, "rule": b.rule, "unit": "share" if b.share else "ns", "limit": b.limit,
                 "percentile": b.percentile, "samples": int(len(values)), "measured": None, "ok": False,
                 "status": "no_data", "worst": []}
        if len(values):
            measured = float(nearest_rank(values, [b.percentile])[0])
            top = np.argsort(-values, kind="stable")[:worst]
            ok = measured <= b.limit
            entry.update(measured=measured if b.share else round(measured), ok=bool(ok),
                         status="ok" if ok else "violated",
                         worst=[_worst(ids[i], float(values[i]) if b.share else int(values[i])) for i in top.tolist()])
        out.append(entry)
    return out
