"""Put every span on the reference timeline (the collector's monotonic clock).

Per node, every clock source becomes hard bounds on offset = node clock - reference:
  - two-way probes to the collector (UDP, gRPC) bound it directly;
  - RPC piggyback samples bound (node - peer) and go through the peer's model;
  - NTP / PTP readings bound (node - UTC) and go through the UTC link, measured from the
    nodes that have both kinds (else the collector's wall clock, flagged as assumed).
The sources of a node are selected and intersected (clock_sync.combine), and all models
are then refined with the trace's causality (clock_sync.causal): RPC servers inside their
clients, receives ending after their sends started, nobody leaving an N x N collective
before the last participant entered. Every aligned time carries its error bound.
"""
import dataclasses

import numpy as np

from ..clock_sync import causal, exchange
from ..clock_sync.combine import combine, compose
from ..clock_sync.exchange import Bounds
from ..clock_sync.model import ClockModel, line, unknown
from ..proto import pb
from ..proto import semconv as sc
from .matching import Matches, answered, is_n_x_n, match
from .spantable import SpanTable

# The one table of assumptions alignment makes.
ASSUMED_COLLECTOR_UTC_ERROR_NS = 10_000_000   # the collector's wall clock vs UTC, when nothing measures it

UNBOUNDED_NS = np.iinfo(np.int64).max // 4
# Aligned times are kept within +-2**61 ns (73 years; real ones are within decades of the
# collector's boot or of 1970): any two of them, and a time and a bound, differ by what int64
# holds. Timestamps a client sent near the ingest limit (2**62) would wrap otherwise.
TIMELINE_LIMIT_NS = 1 << 61
UTC = "utc"
_SOURCE_NAMES = {pb.UDP_EXCHANGE: "udp", pb.GRPC_EXCHANGE: "grpc", pb.RPC_PIGGYBACK: "rpc",
                 pb.NTP: "ntp", pb.PTP: "ptp"}


@dataclasses.dataclass
class Alignment:
    models: dict[str, ClockModel]   # node_id -> model (after refinement)
    start: np.ndarray               # int64 reference ns per span row
    end: np.ndarray
    error: np.ndarray               # int64 bound per row (UNBOUNDED_NS where the node has no model)
    epoch_offset_ns: int            # reference + this = Unix epoch ns
    facts: int = 0                  # causality facts the trace gave
    violations: int = 0             # facts still broken after refinement: a clock inconsistency

    def to_reference(self, node_id: str, local) -> np.ndarray:
        """Other times a node stamped (its spans' events) on the reference timeline, as its
        spans are placed; as they are where the node has no model."""
        local = np.asarray(local, dtype=np.int64)
        model = self.models.get(node_id)
        return model.to_reference(local) if model is not None and model.known else local


# -- per node: sources, selection, composition ---------------------------------------------------

@dataclasses.dataclass
class NodeSources:
    direct: dict[str, Bounds]       # name -> bounds on (node - collector)
    to_utc: dict[str, Bounds]       # name -> bounds on (node - UTC)
    to_peer: dict[str, Bounds]      # peer node_id -> bounds on (node - peer)
    samples: int = 0


def node_sources(rows: list[tuple]) -> NodeSources:
    """A node's stored clock-sample rows (Store.clock_samples) as bounds, by source."""
    grouped: dict[tuple[str, str], list] = {}
    for row in rows:
        _, source, peer, *_ = row
        kind = _SOURCE_NAMES.get(source)
        if kind is None:
            continue
        if kind in ("ntp", "ptp"):
            key = (UTC, row[10] if row[10].startswith(kind) else f"{kind}:{row[10]}")
        elif peer:
            key = ("peer", peer)
        else:
            key = ("direct", kind)
        grouped.setdefault(key, []).append(row)
    out = NodeSources({}, {}, {}, len(rows))
    for (where, name), group in grouped.items():
        cols = list(zip(*group))
        if where == UTC:
            bounds = exchange.from_offsets(cols[7], cols[8], cols[9])
            out.to_utc[name] = bounds
            continue
        bounds = exchange.from_exchanges(cols[3], cols[4], cols[5], cols[6])
        (out.to_peer if where == "peer" else out.direct)[name] = bounds
    return out


def fit_models(store) -> dict[str, ClockModel]:
    """One model per node with spans or clock samples in what the store reads, on the
    collector's clock: not for a node whose data expired (--retain) or lies before a
    report's window (--last), which has nothing to align and would be listed as unsampled."""
    resources = store.nodes()
    rows_by_node: dict[str, list] = {resources[node].node_id: [] for node in store.nodes_with_spans()}
    for row in store.clock_samples():
        if row[0] in resources:
            rows_by_node.setdefault(resources[row[0]].node_id, []).append(row)
    epoch = int(store.meta("epoch_offset_ns") or 0)
    on_utc = {r.node_id for r in resources.values() if r.labels.get(sc.CLOCK_LABEL) == sc.CLOCK_UNIX_EPOCH}
    return fit_sources({node: node_sources(rows) for node, rows in rows_by_node.items()}, epoch, on_utc)


def fit_sources(sources: dict[str, NodeSources], epoch_offset_ns: int,
                on_utc: set[str] = frozenset()) -> dict[str, ClockModel]:
    """Direct sources first; then NTP/PTP through the UTC links; then piggyback through peers
    (named by their rows, Store.clock_samples). A node whose spans are stamped in UTC
    (`on_utc`: OTLP senders, whose times are their wall clock's) and that nothing else
    measures is on the UTC link itself, as good as its NTP."""
    direct = {node: combine(s.direct) for node, s in sources.items()}
    links, utc_link = _utc_links(sources, direct, epoch_offset_ns)

    def via_utc(s: NodeSources) -> dict[str, Bounds]:
        return {n: compose(b, links.get(n, utc_link)) for n, b in s.to_utc.items()}

    def servers_disagree(s: NodeSources) -> bool:   # through the joint link, which had no majority
        return "utc_servers_disagree" in utc_link.flags and any(n not in links for n in s.to_utc)

    models = {node: combine({**s.direct, **via_utc(s)}) for node, s in sources.items()}
    # Piggyback samples go through the peer's model; a chain edge -> gateway -> cloud needs
    # one round per hop.
    used: dict[str, set] = {node: set() for node in sources}
    for _ in range(len(sources)):
        changed = False
        for node, s in sources.items():
            peers = {peer for peer in s.to_peer if peer in models and models[peer].known}
            if peers <= used[node]:
                continue
            used[node] = peers
            via = {f"rpc:{peer}": compose(s.to_peer[peer], models[peer]) for peer in sorted(peers)}
            models[node] = combine({**s.direct, **via_utc(s), **via})
            changed = True
        if not changed:
            break
    out = {}
    for node, model in models.items():
        s = sources[node]
        if not model.known and node in on_utc:
            model = utc_link.with_flags("wall_clock")   # and the link's own flags (utc_servers_disagree)
        if not model.known:
            out[node] = unknown(s.samples)
            continue
        model = dataclasses.replace(model, samples=s.samples)
        if s.to_utc and "utc_link_assumed" in utc_link.flags:
            model = model.with_flags("utc_link_assumed")
        rejected = sorted(n for n in s.to_utc if f"falseticker:{n}" in utc_link.flags)
        if rejected:   # its server disagrees with the others on UTC: so may this node's UTC
            model = model.with_flags(*(f"utc_server_disagrees:{n}" for n in rejected))
        if servers_disagree(s):
            model = model.with_flags("utc_servers_disagree")
        out[node] = model
    return out


def _utc_links(sources, direct: dict[str, ClockModel], epoch_offset_ns: int) -> tuple[dict, ClockModel]:
    """Models of (UTC - collector clock) in UTC time: one per NTP server or PTP grandmaster,
    from every node that has both a direct model and samples of that server; and one of
    them all, whose selection sets aside servers that disagree with the majority (flagged
    falseticker), for nodes whose servers no measured node uses. Each server has its own
    link: one server 50 ms off made a joint link zigzag between two values, and moved every
    node that has NTP alone. Where the servers have no majority, the joint link is the most
    sampled server's (the first by name among equals), flagged utc_servers_disagree, as are
    the nodes that go through it. Without any, the collector's own wall clock, with an
    assumed bound."""
    parts: dict[str, dict[str, Bounds]] = {}
    for node, s in sources.items():
        if not s.to_utc or not direct[node].known:
            continue
        for server, bounds in s.to_utc.items():
            lo, hi = direct[node].bounds_at(bounds.t)
            utc_t = bounds.t - np.rint(bounds.mid).astype(np.int64)
            parts.setdefault(server, {})[node] = Bounds(utc_t, lo - bounds.hi, utc_t.copy(), hi - bounds.lo)
    bounds = {server: exchange.concat(list(by_node.values())) for server, by_node in sorted(parts.items())}
    links = {server: _server_link(server, bounds[server], parts[server]) for server in bounds}
    links = {server: link for server, link in links.items() if link.known}
    if len(links) == 1:
        joint = next(iter(links.values()))
    else:
        joint = combine({server: bounds[server] for server in links}) if links else unknown()
        if not joint.known and links:
            joint = max(links.values(), key=lambda link: link.samples).with_flags("utc_servers_disagree")
    if joint.known:
        return links, joint
    return links, line(epoch_offset_ns, 0.0, 0, ASSUMED_COLLECTOR_UTC_ERROR_NS, flags=("utc_link_assumed",))


def _server_link(server: str, joint: Bounds, by_node: dict[str, Bounds]) -> ClockModel:
    """One server's link: one fit of every node's bounds, which is all it takes while they
    agree (a fit per node cost 12x at 256 nodes). UTC and the collector's clock do not step,
    so a fit that finds a step or an outlier has nodes that disagree (a name such as
    pool.ntp.org is another server on another node): then the nodes are selected as
    sources are, and the ones outside the majority set aside."""
    link = combine({server: joint})
    if len(by_node) > 1 and any(f.startswith(("steps:", "outliers:")) for f in link.flags):
        link = combine(by_node)
    return link


# -- causality facts from the trace --------------------------------------------------------------

def causality(table: SpanTable, matches: Matches, models: list[ClockModel] | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(row_a, a_is_end, row_b, b_is_end): event a happens before event b. Given the nodes'
    models, a collective's every-start-before-every-end facts are only those that may
    bind (causal.may_bind): ranks x ranks facts per instance came to 22M (and 8 GB) for
    512 ranks' 194k spans, when clocks bounded to microseconds leave none."""
    parts = []
    if len(matches.rpc):
        client, server = matches.rpc[:, 0], matches.rpc[:, 1]
        parts.append((client, False, server, False))    # the request leaves before it arrives
        replied = answered(table, client)               # the reply leaves before it arrives
        parts.append((server[replied], True, client[replied], True))
    if len(matches.p2p):   # a receive on a device ends when queued: no fact
        on_host = np.array([host_side(table.attributes[r], sc.P2P_DEVICE) for r in matches.p2p[:, 1].tolist()],
                           dtype=bool)
        parts.append((matches.p2p[on_host, 0], False, matches.p2p[on_host, 1], True))
    rows_a, rows_b = [], []
    # Each node once per instance (the rule): no instance needs _binding_members.
    scoped = matches.coll_instance.astype(np.int64) * max(len(table.nodes), 1) + table.node[matches.coll_rows]
    one_per_node = len(np.unique(scoped)) == len(scoped)
    if models is not None:   # per collective span: its latest possible aligned start, earliest end
        rows = matches.coll_rows
        latest, earliest = np.full(len(table), np.inf), np.full(len(table), -np.inf)
        node = table.node[rows].astype(np.int64)
        latest[rows] = causal.reference_window(models, node, table.start[rows])[1]
        earliest[rows] = causal.reference_window(models, node, table.end[rows])[0]
    for members, op in zip(matches.collective_members(), matches.coll_op):
        if not is_n_x_n(op) or len(members) < 2 or not all(
                _ends_with_the_collective(table.attributes[r]) for r in members.tolist()):
            continue
        starts, ends = (members, members) if one_per_node else _binding_members(table, members)
        if models is not None:   # the members whose start or end some pair may bind
            starts = starts[causal.may_bind(latest[starts], earliest[ends].min())]
            if not len(starts):
                continue
            ends = ends[causal.may_bind(latest[starts].max(), earliest[ends])]
        a, b = np.meshgrid(starts, ends, indexing="ij")
        rows_a.append(a.ravel())
        rows_b.append(b.ravel())
    if rows_a:
        parts.append((np.concatenate(rows_a), False, np.concatenate(rows_b), True))
    if not parts:
        empty = np.empty(0, np.int64)
        return empty, np.empty(0, bool), empty, np.empty(0, bool)
    row_a = np.concatenate([p[0] for p in parts]).astype(np.int64)
    row_b = np.concatenate([p[2] for p in parts]).astype(np.int64)
    a_end = np.concatenate([np.full(len(p[0]), p[1]) for p in parts])
    b_end = np.concatenate([np.full(len(p[2]), p[3]) for p in parts])
    other_node = table.node[row_a] != table.node[row_b]    # one clock cannot contradict itself
    return row_a[other_node], a_end[other_node], row_b[other_node], b_end[other_node]


def _ends_with_the_collective(attributes: dict | None) -> bool:
    """Whether a collective span ends when the collective has completed, as the facts need:
    not an async one (it ends when it was waited for), nor one on a device, which a
    synchronous call only queues (NCCL): a rank 50 ms late there moved a right clock 50 ms."""
    return not attributes or not attributes.get(sc.COLL_ASYNC) and host_side(attributes, sc.COLL_DEVICE)


def host_side(attributes: dict | None, device_key: str) -> bool:
    """Whether a span's tensors were on the host (or it names no device: not torch's)."""
    return not attributes or attributes.get(device_key, "cpu") == "cpu"


def _binding_members(table: SpanTable, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(members whose start, members whose end) give a collective's every-start-before-
    every-end facts: per node, the one that starts last and the one that ends first. One
    clock per node orders its members alike, so they bind all the facts the others would
    give, and the facts stay nodes x nodes however many spans one key gathers (a rank's,
    or thousands a client sent)."""
    nodes = table.node[members]
    by_start = members[np.lexsort((table.start[members], nodes))]
    by_end = members[np.lexsort((table.end[members], nodes))]
    sorted_nodes = np.sort(nodes)
    new_node = np.r_[True, sorted_nodes[1:] != sorted_nodes[:-1]]
    last_of_node = np.r_[new_node[1:], True]
    return by_start[last_of_node], by_end[new_node]


# -- alignment ---------------------------------------------------------------------------------

def align(table: SpanTable, models: dict[str, ClockModel], epoch_offset_ns: int = 0,
          matches: Matches | None = None) -> Alignment:
    if matches is None:
        matches = match(table)
    node_models = [models.get(node_id) or unknown() for node_id in table.nodes]
    known = np.array([m.known for m in node_models] + [False], dtype=bool)
    node = table.node.astype(np.int64)
    for bounded in (node_models, None):
        # Facts the clocks' bounds leave no room to break are not made; where the trace
        # contradicts the bounds and the correction had to leave them, every fact is made.
        row_a, a_end, row_b, b_end = causality(table, matches, bounded)
        usable = known[node[row_a]] & known[node[row_b]]
        row_a, a_end, row_b, b_end = row_a[usable], a_end[usable], row_b[usable], b_end[usable]
        facts = causal.Precedence(node[row_a], np.where(a_end, table.end[row_a], table.start[row_a]),
                                  node[row_b], np.where(b_end, table.end[row_b], table.start[row_b]))
        refined = causal.refine(node_models, facts)
        if not any(causal.BEYOND_BOUND in m.flags for m in refined.models):
            break
    node_models = refined.models
    if len(refined.violations):
        involved = np.concatenate([facts.node_a[refined.violations], facts.node_b[refined.violations]])
        counts = np.bincount(involved, minlength=len(node_models))
        for k in np.flatnonzero(counts).tolist():
            node_models[k] = node_models[k].with_flags(f"causality_violations:{counts[k]}")

    start, end = table.start.copy(), table.end.copy()
    error = np.full(len(table), UNBOUNDED_NS, dtype=np.int64)
    for k, model in enumerate(node_models):
        rows = table.node == k
        if not model.known or not rows.any():
            continue
        start[rows] = model.to_reference(table.start[rows])
        end[rows] = model.to_reference(table.end[rows])
        bound = np.maximum(model.error_at(table.start[rows]), model.error_at(table.end[rows]))
        error[rows] = np.minimum(np.ceil(bound), UNBOUNDED_NS).astype(np.int64)
    np.clip(start, -TIMELINE_LIMIT_NS, TIMELINE_LIMIT_NS, out=start)
    np.clip(end, -TIMELINE_LIMIT_NS, TIMELINE_LIMIT_NS, out=end)
    out_models = dict(models)
    out_models.update({node_id: m for node_id, m in zip(table.nodes, node_models) if node_id in models})
    return Alignment(out_models, start, end, error, epoch_offset_ns, len(facts), len(refined.violations))
