"""Every span as one JSON object per line, on the aligned timeline (for pandas & co).
Beyond its times and attributes a span has its status (UNSET, OK, ERROR) and message,
its events (exceptions among them, at aligned times) and its links."""
from ...proto.semconv import Kind
from ..columns import dumps
from . import aligned_attributes, open_output, outcome


def write(path: str, analysed) -> int:
    """Write the spans to `path` ('-': stdout); returns how many."""
    t, al = analysed.table, analysed.alignment
    kinds = {k.value: k.name for k in Kind}
    with open_output(path) as out:
        for i in range(len(t)):
            out.write(dumps({
                "trace_id": t.trace_ids[t.trace[i]],
                "span_id": f"{int(t.span_id[i]):016x}",
                "parent_span_id": f"{int(t.parent_id[i]):016x}" if t.parent_id[i] else None,
                "name": t.names[t.name[i]],
                "kind": kinds.get(int(t.kind[i]), str(t.kind[i])),
                "node_id": t.nodes[t.node[i]],
                "rank": int(t.resources[t.node[i]].rank),
                "start_ns": int(al.start[i]),
                "end_ns": int(al.end[i]),
                "error_bound_ns": int(al.error[i]),
                "attributes": aligned_attributes(t, al, i),
                **outcome(t, al, i),
            }) + b"\n")
    return len(t)
