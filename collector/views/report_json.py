"""The JSON report (`report --json`, the demo's report.json), written a trace at a time.

json.dump with an indent is pure Python: it took 7.3 s of a 10.8 s report of 250k spans,
where orjson takes 0.5 s; orjson's whole document at once would hold 210 MB more at the
report's peak. So each trace, and each other top-level value, is one orjson call, indented
as json.dump(indent=2) would (orjson indents by two from its own start)."""
from ..columns import dumps
from . import open_output


def _dumps(value, depth: int) -> bytes:
    """`value` indented for its place `depth` levels deep."""
    return dumps(value, indent=True).replace(b"\n", b"\n" + b"  " * depth)


def write(path: str, report: dict) -> None:
    """Write `report` ('-': stdout) as one JSON document."""
    with open_output(path) as out:
        out.write(b"{")
        for k, (key, value) in enumerate(report.items()):
            out.write(b"," if k else b"")
            out.write(b'\n  ' + dumps(str(key)) + b": ")
            if key == "traces" and isinstance(value, list) and value:
                out.write(b"[")
                for i, trace in enumerate(value):
                    out.write((b",\n    " if i else b"\n    ") + _dumps(trace, 2))
                out.write(b"\n  ]")
            else:
                out.write(_dumps(value, 1))
        out.write(b"\n}\n")
        out.flush()
