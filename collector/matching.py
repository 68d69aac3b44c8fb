"""Join spans across nodes by their keys: RPC client/server, send/recv, collectives.

These joins need no clock: they use ids and the keys the tracers put on spans
(proto/semconv.py). Alignment uses them as causality constraints, the DAG as edges.
"""
import dataclasses

import numpy as np

from ..proto import semconv as sc
from ..proto.semconv import Kind
from .spantable import SpanTable


@dataclasses.dataclass
class Matches:
    rpc: np.ndarray            # (k, 2) int: client row, server row
    p2p: np.ndarray            # (k, 2) int: send row, recv row
    coll_rows: np.ndarray      # rows of collective spans, grouped by instance
    coll_instance: np.ndarray  # instance index of each coll_rows entry (same length)
    coll_expected: np.ndarray  # participants each instance should have (group size; 0 = unknown)
    coll_op: list[str]         # op name per instance
    unmatched: dict[str, np.ndarray]  # "rpc_client", "rpc_server", "send", "recv", "collective" -> rows

    @property
    def n_collectives(self) -> int:
        return len(self.coll_expected)

    def collective_members(self) -> list[np.ndarray]:
        """Rows of each collective instance (a list; use coll_rows/coll_instance to vectorise)."""
        order = np.argsort(self.coll_instance, kind="stable")
        bounds = np.flatnonzero(np.diff(self.coll_instance[order])) + 1
        return np.split(self.coll_rows[order], bounds) if len(order) else []


def _pair_by_key(keys_a: list, rows_a: np.ndarray, keys_b: list, rows_b: np.ndarray):
    """Equality join of two key lists (first match wins); returns (pairs, unmatched_a, unmatched_b)."""
    index = {}
    for key, row in zip(keys_a, rows_a.tolist()):
        index.setdefault(key, row)
    pairs, used = [], set()
    for key, row in zip(keys_b, rows_b.tolist()):
        a = index.get(key)
        if a is not None and a not in used:
            used.add(a)
            pairs.append((a, row))
    matched_b = {b for _, b in pairs}
    pairs_arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return (pairs_arr, np.array([r for r in rows_a.tolist() if r not in used], dtype=np.int64),
            np.array([r for r in rows_b.tolist() if r not in matched_b], dtype=np.int64))


def match(table: SpanTable) -> Matches:
    kind = table.kind
    jobs = [r.job_id for r in table.resources]
    node = table.node

    # RPC: the server span's parent is the client span (W3C traceparent).
    clients = np.flatnonzero(kind == Kind.RPC_CLIENT)
    servers = np.flatnonzero(kind == Kind.RPC_SERVER)
    rpc, lone_clients, lone_servers = _pair_by_key(
        list(zip(table.trace[clients].tolist(), table.span_id[clients].tolist())), clients,
        list(zip(table.trace[servers].tolist(), table.parent_id[servers].tolist())), servers)

    # Point-to-point: a send and its receive share (job, src, dst, tag, seq).
    def p2p_keys(rows):
        return [(jobs[n], a.get(sc.P2P_SRC), a.get(sc.P2P_DST), a.get(sc.P2P_TAG), a.get(sc.P2P_SEQ))
                if (a := table.attributes[r]) is not None else None
                for r, n in zip(rows.tolist(), node[rows].tolist())]

    sends = np.flatnonzero(kind == Kind.SEND)
    recvs = np.flatnonzero(kind == Kind.RECV)
    p2p, lone_sends, lone_recvs = _pair_by_key(p2p_keys(sends), sends, p2p_keys(recvs), recvs)

    # Collectives: every participant of one instance has the same (job, group, seq).
    colls = np.flatnonzero(kind == Kind.COLLECTIVE)
    instance_of: dict = {}
    rows, instance, expected, ops, lone = [], [], [], [], []
    for r, n in zip(colls.tolist(), node[colls].tolist()):
        a = table.attributes[r] or {}
        group, seq = a.get(sc.COLL_GROUP), a.get(sc.COLL_SEQ)
        if group is None or seq is None:
            lone.append(r)
            continue
        key = (jobs[n], group, seq)
        i = instance_of.get(key)
        if i is None:
            i = instance_of[key] = len(expected)
            ranks = a.get(sc.COLL_RANKS)
            expected.append(len(ranks) if isinstance(ranks, list) else 0)
            ops.append(str(a.get(sc.COLL_OP, table.names[table.name[r]])))
        rows.append(r)
        instance.append(i)
    instance_arr = np.array(instance, dtype=np.int64)
    expected_arr = np.array(expected, dtype=np.int64)
    counts = np.bincount(instance_arr, minlength=len(expected)) if len(expected) else np.zeros(0, np.int64)
    short = set(np.flatnonzero((expected_arr > 0) & (counts < expected_arr)).tolist())
    lone_colls = np.array(lone + [r for r, i in zip(rows, instance) if i in short], dtype=np.int64)
    return Matches(
        rpc=rpc, p2p=p2p, coll_rows=np.array(rows, dtype=np.int64), coll_instance=instance_arr,
        coll_expected=expected_arr, coll_op=ops,
        unmatched={"rpc_client": lone_clients, "rpc_server": lone_servers, "send": lone_sends,
                   "recv": lone_recvs, "collective": lone_colls})
