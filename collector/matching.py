"""Join spans across nodes by their keys: RPC client/server, send/recv, collectives.

These joins need no clock: they use ids and the keys the tracers put on spans
(proto/semconv.py). Alignment uses them as causality constraints, the DAG as edges.
Equal keys pair in order of appearance (the i-th send with key k pairs with the i-th
receive with key k); whatever finds no partner is listed in `unmatched`.
"""
import dataclasses

import numpy as np

from ..proto import semconv as sc
from ..proto.semconv import Kind
from .spantable import SpanTable

_NONE = np.empty(0, dtype=np.int64)

# Collectives whose definition makes everyone wait for the last to enter (every entry comes
# before every exit), by op name (lower case, no underscores, as a prefix:
# all_gather_into_tensor is an allgather). Alignment makes clock facts from these only: a
# rooted op (broadcast, scatter, reduce, gather) may let some leave early (an NCCL
# broadcast's root, with a small message).
N_X_N_OPS = ("allreduce", "allgather", "reducescatter", "alltoall", "barrier", "monitoredbarrier")
# Rooted collectives whose non-roots wait for the root alone on the host (gloo, measured:
# collector/dag.py); the root waits for everyone. (A reduce holds everyone up.)
ROOT_RELEASED_OPS = ("broadcast", "gather", "scatter")


def released_by_root(op: str) -> bool:
    return _op_is(op, ROOT_RELEASED_OPS)


def is_n_x_n(op: str) -> bool:
    """Whether every member of collective `op` must enter before any leaves."""
    return _op_is(op, N_X_N_OPS)


def _op_is(op: str, names: tuple[str, ...]) -> bool:
    """Whether `op` is one of `names`, which are written lower case, without underscores."""
    return op.lower().replace("_", "").startswith(names)


# gRPC statuses a client gives a call it gave up on itself (its deadline, a cancel, a lost
# connection): no reply of the server's reached it, so the server's end need not come before
# the client's (a server that noticed the deadline late ended after it), and alignment makes
# no clock fact of it. The DAG keeps its response edge: until it gave up, the client waited
# on the server's work, which is what its critical path shows.
ABANDONED_RPC_STATUSES = frozenset((1, 4, 14))   # CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE


def answered(table: SpanTable, clients: np.ndarray) -> np.ndarray:
    """Per RPC client row: whether the server's reply reached it (not ABANDONED_RPC_STATUSES)."""
    codes = table.attr(sc.RPC_GRPC_STATUS, clients.tolist())
    return np.fromiter((code not in ABANDONED_RPC_STATUSES if isinstance(code, int) else True for code in codes),
                       dtype=bool, count=len(codes))


@dataclasses.dataclass
class Matches:
    rpc: np.ndarray            # (k, 2) int: client row, server row
    p2p: np.ndarray            # (k, 2) int: send row, recv row
    coll_rows: np.ndarray      # rows of collective spans, grouped by instance
    coll_instance: np.ndarray  # instance index of each coll_rows entry (same length)
    coll_expected: np.ndarray  # participants each instance should have (group size; 0 = unknown)
    coll_op: list[str]         # op name per instance
    unmatched: dict[str, np.ndarray]  # "rpc_client", "rpc_server", "send", "recv", "collective" -> rows
    coll_group: list = dataclasses.field(default_factory=list)  # group name per instance
    coll_seq: list = dataclasses.field(default_factory=list)    # group-local sequence number per instance

    @property
    def n_collectives(self) -> int:
        return len(self.coll_expected)

    def collective_members(self) -> list[np.ndarray]:
        """Rows of each collective instance (a list; use coll_rows/coll_instance to vectorise)."""
        order = np.argsort(self.coll_instance, kind="stable")
        bounds = np.flatnonzero(np.diff(self.coll_instance[order])) + 1
        return np.split(self.coll_rows[order], bounds) if len(order) else []


def intern(keys: list) -> np.ndarray:
    """Dense int ids for keys (equal keys, equal ids; None stays -1, and so does a key that
    holds a list or an object, which a client may send as a join attribute: no key)."""
    ids: dict = {}
    try:
        return np.array([-1 if k is None else ids.setdefault(k, len(ids)) for k in keys], dtype=np.int64)
    except TypeError:   # such a key: the rare slow path, key by key
        return np.array([_key_id(ids, k) for k in keys], dtype=np.int64)


def _key_id(ids: dict, key) -> int:
    try:
        return -1 if key is None else ids.setdefault(key, len(ids))
    except TypeError:
        return -1


def occurrence(ids: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries have the same id (0 for the first)."""
    if not len(ids):
        return _NONE
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(ids)), 0))
    out = np.empty(len(ids), dtype=np.int64)
    out[order] = np.arange(len(ids)) - first
    return out


def pair(ids_a: np.ndarray, rows_a: np.ndarray, ids_b: np.ndarray, rows_b: np.ndarray):
    """Equality join on key ids (-1: no key), the i-th a of a key with the i-th b of that key.
    Returns (pairs (k, 2) of rows, unmatched rows of a, unmatched rows of b)."""
    va, vb = np.flatnonzero(ids_a >= 0), np.flatnonzero(ids_b >= 0)
    width = max(len(ids_a), len(ids_b)) + 1        # more than any key's occurrences
    ka = ids_a[va] * width + occurrence(ids_a[va])
    kb = ids_b[vb] * width + occurrence(ids_b[vb])
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    ia, ib = va[ia], vb[ib]
    pairs = np.stack([rows_a[ia], rows_b[ib]], axis=1).astype(np.int64).reshape(-1, 2)
    lone_a = np.ones(len(rows_a), dtype=bool)
    lone_a[ia] = False
    lone_b = np.ones(len(rows_b), dtype=bool)
    lone_b[ib] = False
    return pairs, rows_a[lone_a].astype(np.int64), rows_b[lone_b].astype(np.int64)


def _same_size(table: SpanTable, pairs: np.ndarray, lone_sends: np.ndarray, lone_recvs: np.ndarray):
    """(pairs, lone sends, lone receives) less the pairs whose sizes differ, which are not
    one message (torch requires a receive's size to be the send's): a receive from any
    source, numbered when it completes (tracer/instrument/torch_dist.py), can take another
    send's number. Those stay unmatched rather than joined wrong."""
    if not len(pairs):
        return pairs, lone_sends, lone_recvs
    sent, got = table.attr(sc.P2P_BYTES, pairs[:, 0].tolist()), table.attr(sc.P2P_BYTES, pairs[:, 1].tolist())
    differ = np.array([a is not None and b is not None and a != b for a, b in zip(sent, got)], dtype=bool)
    if not differ.any():
        return pairs, lone_sends, lone_recvs
    return (pairs[~differ], np.sort(np.concatenate([lone_sends, pairs[differ, 0]])),
            np.sort(np.concatenate([lone_recvs, pairs[differ, 1]])))


def scopes(table: SpanTable) -> np.ndarray:
    """What each span's sequence number (a collective's, a transfer's) counts within, as one
    int: its job, and its step's trace where it ran in a step (a trace whose root span
    carries the step number), else its run where the span names one. The counters of two
    runs of one job both start at 0; their steps' traces differ, and so do the run ids the
    tracer gives collectives and transfers (tracer/step.py run_id), so one run's are never
    joined with another's."""
    roots = np.flatnonzero(table.parent_id == 0)
    steps = roots[[a is not None and sc.STEP in a for a in map(table.attributes.__getitem__, roots.tolist())]]
    in_step = np.zeros(len(table.trace_ids), dtype=bool)
    in_step[table.trace[steps.astype(np.int64)]] = True
    jobs: dict = {}
    job_of_node = np.array([jobs.setdefault(r.job_id, len(jobs)) for r in table.resources], dtype=np.int64)
    traces = table.trace.astype(np.int64)
    per_job = len(in_step) + 1
    scope = job_of_node[table.node] * per_job + np.where(in_step[traces], traces + 1, 0)
    loose = np.flatnonzero(~in_step[traces] & table.is_kind(Kind.COLLECTIVE, Kind.SEND, Kind.RECV))
    run = intern(table.attr(sc.RUN_ID, loose.tolist()))   # -1: none (or not a key)
    scope[loose] += (run + 1) * (max(len(jobs), 1) * per_job)
    return scope


def _p2p_keys(table: SpanTable, rows: np.ndarray, scope: np.ndarray) -> list:
    """Key (scope, src, dst, tag, seq, group) per row; None without src, dst or seq (the
    group is None from tracers that did not send it, on both sides alike)."""
    cols = [table.attr(key, rows) for key in (sc.P2P_SRC, sc.P2P_DST, sc.P2P_TAG, sc.P2P_SEQ, sc.P2P_GROUP)]
    return [None if k[1] is None or k[2] is None or k[4] is None else k
            for k in zip(scope[rows].tolist(), *cols)]


def match(table: SpanTable) -> Matches:
    kind = table.kind

    # RPC: the server span's parent is the client span (W3C traceparent).
    clients = np.flatnonzero(kind == Kind.RPC_CLIENT)
    servers = np.flatnonzero(kind == Kind.RPC_SERVER)
    ids = intern(list(zip(table.trace[clients].tolist(), table.span_id[clients].tolist()))
                 + list(zip(table.trace[servers].tolist(), table.parent_id[servers].tolist())))
    rpc, lone_clients, lone_servers = pair(ids[:len(clients)], clients, ids[len(clients):], servers)

    # Point-to-point: a send and its receive share (scope, src, dst, tag, seq, group).
    scope = scopes(table)
    sends = np.flatnonzero(kind == Kind.SEND)
    recvs = np.flatnonzero(kind == Kind.RECV)
    ids = intern(_p2p_keys(table, sends, scope) + _p2p_keys(table, recvs, scope))
    p2p, lone_sends, lone_recvs = _same_size(table, *pair(ids[:len(sends)], sends, ids[len(sends):], recvs))

    # Collectives: every participant of one instance has the same (scope, group, seq).
    colls = np.flatnonzero(kind == Kind.COLLECTIVE)
    groups, seqs = table.attr(sc.COLL_GROUP, colls), table.attr(sc.COLL_SEQ, colls)
    keys = [None if g is None or s is None else (j, g, s)
            for j, g, s in zip(scope[colls].tolist(), groups, seqs)]
    instance_all = intern(keys)
    keyed = instance_all >= 0
    rows, instance = colls[keyed], instance_all[keyed]
    _, first = np.unique(instance, return_index=True)      # first member of each instance
    n = len(first)
    first_rows = rows[first].tolist()
    ranks = table.attr(sc.COLL_RANKS, first_rows)
    expected = np.array([len(r) if isinstance(r, list) else 0 for r in ranks], dtype=np.int64)
    ops = [str(op) if op is not None else table.names[table.name[r]]
           for op, r in zip(table.attr(sc.COLL_OP, first_rows), first_rows)]
    counts = np.bincount(instance, minlength=n)
    short = (expected > 0) & (counts < expected)
    lone_colls = np.sort(np.concatenate([colls[~keyed], rows[short[instance]]])).astype(np.int64)
    first_attrs = [table.attributes[r] for r in first_rows]
    return Matches(
        rpc=rpc, p2p=p2p, coll_rows=rows.astype(np.int64), coll_instance=instance,
        coll_expected=expected, coll_op=ops,
        unmatched={"rpc_client": lone_clients, "rpc_server": lone_servers, "send": lone_sends,
                   "recv": lone_recvs, "collective": lone_colls},
        coll_group=[a[sc.COLL_GROUP] for a in first_attrs], coll_seq=[a[sc.COLL_SEQ] for a in first_attrs])
