"""The numbers behind the store: spans/s committed, with deduplication, by the candidates.

- sqlite rows: one row per span, PRIMARY KEY (trace, span) for deduplication and lookup
- duckdb rows: one row per span from Arrow, PRIMARY KEY (trace, span), INSERT OR IGNORE
- crosstrace: the collector's Store (SQLite WAL, one columnar segment per batch, a
  window of recent span keys for deduplication), fed the same spans as tracer batches

Batches of 8192 spans (the tracer's batch size), one transaction each, spans of 64-span
traces, in the same run. `pip install duckdb pyarrow` to include DuckDB.

    python bench/store_choice.py [--batches N]
"""
import argparse
import os
import sqlite3
import tempfile
import time

import numpy as np

from crosstrace.collector.ingest import check
from crosstrace.collector.store import Store
from crosstrace.proto import pb

BATCH = 8192


def make_batches(n_batches: int) -> list[dict]:
    out = []
    for b in range(n_batches):
        rng = np.random.default_rng(b)
        traces = BATCH // 64
        cols = {
            "trace_id_hi": rng.integers(1, 2**63, traces, dtype=np.int64).astype("<u8").repeat(64),
            "trace_id_lo": rng.integers(1, 2**63, traces, dtype=np.int64).astype("<u8").repeat(64),
            "span_id": rng.integers(1, 2**63, BATCH, dtype=np.int64).astype("<u8"),
            "parent_span_id": rng.integers(1, 2**63, BATCH, dtype=np.int64).astype("<u8"),
            "start_ns": np.arange(BATCH, dtype="<i8") * 1000 + b * 10**9,
            "kind": np.ones(BATCH, "u1"), "status": np.zeros(BATCH, "u1"),
            "name": rng.integers(0, 20, BATCH).astype("<u4"), "thread": np.full(BATCH, 7, "<u8"),
        }
        cols["end_ns"] = cols["start_ns"] + 500
        out.append(cols)
    return out


def rate(fn, batches) -> float:
    t0 = time.perf_counter()
    fn(batches)
    return len(batches) * BATCH / (time.perf_counter() - t0)


def sqlite_rows(path):
    def run(batches):
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE spans (th INT, tl INT, sid INT, parent INT, name INT, kind INT, st INT, en INT, "
                   "thread INT, PRIMARY KEY (th, tl, sid)) WITHOUT ROWID")
        for c in batches:
            rows = zip(*(c[k].astype(np.uint64).view(np.int64).tolist()
                         for k in ("trace_id_hi", "trace_id_lo", "span_id", "parent_span_id", "name", "kind",
                                   "start_ns", "end_ns", "thread")))
            db.execute("BEGIN")
            db.executemany("INSERT OR IGNORE INTO spans VALUES (?,?,?,?,?,?,?,?,?)", rows)
            db.execute("COMMIT")
        db.close()
    return run


def duckdb_rows(path):
    import duckdb
    import pyarrow as pa

    def run(batches):
        db = duckdb.connect(path)
        db.execute("CREATE TABLE spans (th UBIGINT, tl UBIGINT, sid UBIGINT, parent UBIGINT, name UINTEGER, "
                   "kind UTINYINT, st BIGINT, en BIGINT, thread UBIGINT, PRIMARY KEY (th, tl, sid))")
        for c in batches:
            arrow = pa.table({"th": c["trace_id_hi"], "tl": c["trace_id_lo"], "sid": c["span_id"],
                              "parent": c["parent_span_id"], "name": c["name"], "kind": c["kind"],
                              "st": c["start_ns"], "en": c["end_ns"], "thread": c["thread"]})
            db.execute("BEGIN")
            db.execute("INSERT OR IGNORE INTO spans SELECT * FROM arrow")
            db.execute("COMMIT")
        db.close()
    return run


def crosstrace_store(path):
    def run(batches):
        store = Store(path)
        for seq, c in enumerate(batches, 1):
            batch = pb.SpanBatch(resource=pb.Resource(node_id="bench"), session_id=b"s" * 16, seq=seq,
                                 count=BATCH, strings=[f"op{i}" for i in range(20)],
                                 attributes_json=b"[" + b",".join([b"null"] * BATCH) + b"]")
            for field, values in c.items():
                setattr(batch, field, values.tobytes())
            store.write([check(pb.SpanBatch.FromString(batch.SerializeToString()))])
        store.close()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=200, help="batches of 8192 spans (default 200: 1.6M spans)")
    args = parser.parse_args()
    batches = make_batches(args.batches)
    candidates = {"sqlite, row per span": sqlite_rows, "crosstrace segments (SQLite)": crosstrace_store}
    try:
        import duckdb  # noqa: F401
        import pyarrow  # noqa: F401
        candidates["duckdb, row per span (Arrow)"] = duckdb_rows
    except ImportError:
        print("duckdb/pyarrow not installed: skipping DuckDB")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in candidates.items():
            path = os.path.join(tmp, name.split()[0] + ".db")
            results[name] = rate(make(path), batches)
            size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith(name.split()[0]))
            print(f"{name:32s} {results[name]:>12,.0f} spans/s committed   {size / (len(batches) * BATCH):6.0f} B/span")
    base = results["sqlite, row per span"]
    for name, value in results.items():
        print(f"ratio {name} / sqlite rows: {value / base:.2f}x")


if __name__ == "__main__":
    main()
