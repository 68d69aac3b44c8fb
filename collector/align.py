"""Put every span on the reference timeline (the collector's monotonic clock).

Fits one clock model per node from the stored clock samples and maps each span's
local start/end through it; every aligned time carries its node's error bound.
"""
import dataclasses

import numpy as np

from ..clock_sync.exchange import fit_min_delay, offset_bounds
from ..clock_sync.model import ClockModel, unknown
from ..proto import pb
from .spantable import SpanTable

_TWO_WAY_TO_COLLECTOR = (pb.GRPC_EXCHANGE, pb.UDP_EXCHANGE)


@dataclasses.dataclass
class Alignment:
    models: dict[str, ClockModel]   # node_id -> model
    start: np.ndarray               # int64 reference ns per span row
    end: np.ndarray
    error: np.ndarray               # int64 bound per row (huge where the node has no model)
    epoch_offset_ns: int            # reference + this = Unix epoch ns


def fit_models(store) -> dict[str, ClockModel]:
    """One model per node that has sent anything."""
    nodes = store.nodes()
    by_node: dict[int, list] = {n: [] for n in nodes}
    for row in store.clock_samples():
        by_node.setdefault(row[0], []).append(row)
    models = {}
    for node, rows in by_node.items():
        exchanges = [r for r in rows if r[1] in _TWO_WAY_TO_COLLECTOR and not r[2]]
        if not exchanges:
            models[nodes[node].node_id] = unknown(len(rows))
            continue
        _, _, _, t1, t2, t3, t4 = zip(*(r[:7] for r in exchanges))
        lo, hi = offset_bounds(t1, t2, t3, t4)
        models[nodes[node].node_id] = fit_min_delay(np.asarray(t1), lo, hi, source="grpc_exchange")
    return models


UNBOUNDED_NS = np.iinfo(np.int64).max // 4


def align(table: SpanTable, models: dict[str, ClockModel], epoch_offset_ns: int = 0) -> Alignment:
    start = table.start.copy()
    end = table.end.copy()
    error = np.full(len(table), UNBOUNDED_NS, dtype=np.int64)
    for node_index, node_id in enumerate(table.nodes):
        model = models.get(node_id)
        rows = table.node == node_index
        if model is None or not model.known:
            continue
        start[rows] = model.to_reference(table.start[rows])
        end[rows] = model.to_reference(table.end[rows])
        error[rows] = int(np.ceil(model.error_ns))
    return Alignment(models, start, end, error, epoch_offset_ns)
