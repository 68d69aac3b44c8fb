"""The command line as users run it: demo, report (terminal and JSON), export, help."""
import collections
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from crosstrace.demo import injected_offset_at

from .conftest import first_line, run_python, tracer_env
from .test_collector_input import batch, export


def crosstrace(*args, timeout=300, cwd=None, run_as=()) -> subprocess.CompletedProcess:
    return subprocess.run([*run_as, sys.executable, "-m", "crosstrace", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def one_line_error(result, *words) -> bool:
    """Exit 2 with an error line that has `words`, after progress lines at most."""
    lines = result.stderr.strip().splitlines()
    return (result.returncode == 2 and lines[-1].startswith("crosstrace: error:") and all(w in lines[-1] for w in words)
            and all(line.startswith("crosstrace: ") for line in lines))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The README's main command, every workload: RPC chain, edge to cloud, DDP, pipeline."""
    out = tmp_path_factory.mktemp("demo")
    result = crosstrace("demo", "--out", str(out), "--requests", "10", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result


def test_demo_runs_end_to_end_and_recovers_the_injected_clocks(demo):
    out, result = demo
    report = json.loads((out / "report.json").read_text())
    assert set(report["demo"]["workloads"]) == {"rpc", "edge", "ddp", "pipeline"}
    rpc = [t for t in report["traces"] if "frontend" in t["per_rank"]]
    assert len(rpc) == 10 and all(t["nodes"] == 3 and t["spans"] == 8 for t in rpc)
    for node, truth in report["demo"]["injected_clocks"].items():
        clock = report["clocks"][node]
        injected = injected_offset_at(truth, report["demo"]["clock_epoch_ns"], clock["at_local_ns"])
        assert abs(clock["offset_ns"] - injected) <= clock["error_bound_ns"], node
    assert "clock recovery" in result.stdout and "slowest traces" in result.stdout
    assert {f.name for f in out.iterdir()} >= {"report.json", "report.html", "trace.json", "store.db"}
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert report["dropped_spans"] == {} or not any(report["dropped_spans"].values())


def test_demo_names_the_injected_straggler(demo):
    out, result = demo
    report = json.loads((out / "report.json").read_text())
    ddp = report["demo"]["workloads"]["ddp"]
    steps = [t for t in report["traces"] if "trainer-0" in t["per_rank"]]
    assert len(steps) == ddp["steps"]
    named = [t["straggler"]["node"] for t in steps if t["straggler"]]
    assert named.count(ddp["straggler_node"]) >= len(steps) // 2, named
    # The terminal report says so under the steps' summary (it named the slowest trace's only).
    assert f"stragglers: {ddp['straggler_node']} in {named.count(ddp['straggler_node'])} of" in result.stdout


def test_report_json_has_the_documented_shape(demo, tmp_path):
    out, _ = demo
    path = tmp_path / "r.json"
    result = crosstrace("report", "--store", str(out / "store.db"), "--json", str(path))
    assert result.returncode == 0, result.stderr
    report = json.loads(path.read_text())
    assert set(report) >= {"traces", "clocks", "dropped_spans"}
    trace = report["traces"][0]
    assert set(trace) >= {"trace_id", "name", "start_ns", "duration_ns", "spans", "nodes", "critical_path",
                          "attribution", "per_rank"}
    assert set(next(iter(report["clocks"].values()))) >= {"offset_ns", "drift_ppm", "error_bound_ns", "samples"}


def test_export_jsonl_writes_every_span_on_the_aligned_timeline(demo, tmp_path):
    out, _ = demo
    path = tmp_path / "spans.jsonl"
    result = crosstrace("export", "--store", str(out / "store.db"), "--jsonl", str(path))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    report = json.loads((out / "report.json").read_text())
    assert len(rows) == sum(t["spans"] for t in report["traces"])
    assert set(rows[0]) == {"trace_id", "span_id", "parent_span_id", "name", "kind", "node_id", "rank",
                            "start_ns", "end_ns", "error_bound_ns", "attributes", "status", "status_message",
                            "events", "links"}
    by_id = {r["span_id"]: r for r in rows}
    # A DDP bucket's ready time with it: after its parent began, before it was issued.
    buckets = [r for r in rows if r["name"] == "ddp.all_reduce" and "ddp.ready_ns" in r["attributes"]]
    assert buckets
    for r in buckets:
        slack = 2 * r["error_bound_ns"]
        assert by_id[r["parent_span_id"]]["start_ns"] - slack <= r["attributes"]["ddp.ready_ns"] <= r["start_ns"] + slack
    # The Perfetto file has it so too.
    perfetto = {e["args"]["span_id"]: e["args"] for e in json.loads((out / "trace.json").read_text())["traceEvents"]
                if e.get("ph") == "X" and e["name"] == "ddp.all_reduce"}
    assert all(perfetto[r["span_id"]]["attributes"]["ddp.ready_ns"] == r["attributes"]["ddp.ready_ns"] for r in buckets)
    # Aligned: every RPC server span lies inside its client span despite offsets of hundreds of ms.
    for r in rows:
        if r["kind"] == "RPC_SERVER":
            client = by_id[r["parent_span_id"]]
            slack = r["error_bound_ns"] + client["error_bound_ns"]
            assert client["start_ns"] - slack <= r["start_ns"] and r["end_ns"] <= client["end_ns"] + slack


@pytest.mark.parametrize("command", [("export", "--jsonl", "-"), ("report",)])
def test_output_piped_into_a_reader_that_stops_ends_quietly(demo, command):
    """`crosstrace export --jsonl - | head` printed `error: [Errno 32] Broken pipe` and exited
    2; a terminal report so cut exited 1. Now as a program that SIGPIPE ends: 141, no message."""
    out, _ = demo
    proc = subprocess.Popen([sys.executable, "-m", "crosstrace", command[0], "--store", str(out / "store.db"),
                             *command[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(100)
    proc.stdout.close()   # more than a pipe holds is still to come (740 spans)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert "error" not in err.decode() and "Traceback" not in err.decode()


def test_failed_spans_show_their_status_and_exception_in_every_view(collector, tmp_path):
    """A span that raised: its ERROR status, message and exception event (at an aligned time
    inside the span, from a node whose clock is 3 s off) in the JSONL, the Perfetto args,
    the JSON report's error count and the terminal."""
    run_python("""
        import time
        import crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        with tracer.start_as_current_span("request"):
            try:
                with tracer.start_as_current_span("load"):
                    time.sleep(0.01)
                    raise KeyError("model-7")
            except KeyError:
                pass
            time.sleep(0.01)
        assert p.force_flush(10000)
    """, env=tracer_env(collector, "server", sim_clock_offset_ns=3_000_000_000))
    store = collector.store
    result = crosstrace("export", "--store", store, "--jsonl", "-", "--perfetto", str(tmp_path / "p.json"))
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in map(json.loads, result.stdout.splitlines())}
    load, request = rows["load"], rows["request"]
    assert request["status"] == "UNSET" and request["events"] == [] and request["status_message"] is None
    assert load["status"] == "ERROR" and load["status_message"] == "KeyError: 'model-7'"
    (event,) = load["events"]
    assert event["name"] == "exception" and event["attributes"]["exception.type"] == "KeyError"
    assert load["start_ns"] + 10_000_000 <= event["time_ns"] <= load["end_ns"]   # aligned, not 3 s off
    slices = {e["name"]: e for e in json.loads((tmp_path / "p.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert slices["load"]["args"]["status"] == "ERROR" and slices["load"]["args"]["events"] == load["events"]
    assert "status" not in slices["request"]["args"]
    report = crosstrace("report", "--store", store, "--json", "-")
    assert [t["errors"] for t in json.loads(report.stdout)["traces"]] == [1]
    terminal = crosstrace("report", "--store", store)
    assert "1 span with status ERROR in 1 trace" in " ".join(terminal.stdout.split()), terminal.stdout


def test_help_answers_and_errors_are_clear(tmp_path):
    result = crosstrace("--help")
    assert result.returncode == 0 and "demo" in result.stdout and "collector" in result.stdout
    result = crosstrace("report", "--store", str(tmp_path / "missing.db"))
    assert result.returncode == 2 and "no crosstrace store at" in result.stderr
    # A file's error names the file, without Python's errno ("[Errno 2] ...").
    result = crosstrace("budget", "check", "--store", str(tmp_path / "missing.db"), "--budget", "nosuch.toml")
    assert one_line_error(result, "nosuch.toml: No such file or directory") and "Errno" not in result.stderr
    (tmp_path / "a-file").write_text("")
    result = crosstrace("demo", "--out", str(tmp_path / "a-file"))
    assert one_line_error(result, "a-file is a file; give --out a folder"), result.stderr


def test_collector_cli_stops_cleanly_on_sigterm(collector):
    run_python("""
        import crosstrace
        p = crosstrace.init()
        with p.get_tracer("t").start_as_current_span("x"):
            pass
        assert p.force_flush(10000)
    """, env=tracer_env(collector, "cli"))
    assert collector.stop() == 0


def test_a_collector_says_when_its_store_is_new(tmp_path):
    """A mistyped --store started an empty store of its own (its folders too), unsaid."""
    store = str(tmp_path / "no" / "such" / "s.db")
    lines = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-m", "crosstrace", "collector", "--listen", "127.0.0.1:0",
                                 "--store", store], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            lines.append(first_line(proc))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            proc.wait(10)
    assert f"store {store} (new)" in lines[0] and "(new)" not in lines[1], lines


def test_a_collector_whose_output_is_gone_still_stops_on_sigterm(tmp_path):
    """`crosstrace collector ... | head -2`: once head exits, a progress line failed, the
    loop that waits for the signal ended, and SIGTERM no longer stopped the collector (its
    server's threads kept it up, holding port and store, until SIGKILL)."""
    proc = subprocess.Popen([sys.executable, "-m", "crosstrace", "collector", "--listen", "127.0.0.1:0",
                             "--store", str(tmp_path / "s.db")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        address = first_line(proc).split()[4].rstrip(",")
        proc.stdout.close()
        proc.stderr.close()
        run_python("""
            import crosstrace
            p = crosstrace.init()
            with p.get_tracer("t").start_as_current_span("x"):
                pass
            assert p.force_flush(10000)
        """, env={"CROSSTRACE_ENDPOINT": address, "CROSSTRACE_NODE_ID": "piped"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait(10)


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment holds `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/environ", "rb") as g:
                if text.encode() in f.read() + g.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_demo_stops_its_collector_and_workers(tmp_path, sig):
    """SIGTERM, or SIGHUP (its terminal closed): the demo stops its workers and collector,
    which run in sessions of their own (a hangup left them running for good)."""
    demo = subprocess.Popen([sys.executable, "-m", "crosstrace", "demo", "--workloads", "rpc", "--requests", "100000",
                             "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = threading.Timer(120, demo.kill)
    killer.start()
    try:
        address = None
        for line in demo.stdout:
            match = re.search(r"collector listening on (\S+)", line)
            address = match.group(1) if match else address
            if line.startswith("demo: rpc:"):
                break
        assert address, "the demo did not start its collector"
        deadline = time.monotonic() + 60
        while len(_processes_mentioning(f"CROSSTRACE_ENDPOINT={address}")) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)   # the three RPC workers
        assert len(_processes_mentioning(f"CROSSTRACE_ENDPOINT={address}")) == 3
        demo.send_signal(sig)
        assert demo.wait(60) == 128 + sig
        rest = demo.stdout.read()
        assert "interrupted" in rest and "Traceback" not in rest
        deadline = time.monotonic() + 20
        while (_processes_mentioning(f"CROSSTRACE_ENDPOINT={address}") or _processes_mentioning(str(tmp_path))) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _processes_mentioning(f"CROSSTRACE_ENDPOINT={address}")
        assert not _processes_mentioning(str(tmp_path / "store.db"))
    finally:
        killer.cancel()
        demo.kill()


# Traces A and B share their high half (segments are found by it), C differs from the 4th digit.
TRACES = [(0xabcd000000000001, 0x1000000000000000), (0xabcd000000000001, 0x2000000000000000),
          (0xabce000000000000, 0x3000000000000000)]
BIG = 1 << 70   # beyond 64 bits: JSON allows it, orjson does not write it


@pytest.fixture
def three_traces(collector):
    """A store with two spans in each trace of TRACES, one of them with a BIG attribute."""
    hi, lo = (np.repeat(np.array(half, dtype="<u8"), 2) for half in zip(*TRACES))
    attributes = b'[{"big": %d}' % BIG + b",null" * 5 + b"]"
    acks, err = export(collector.address, [batch(6, trace_id_hi=hi, trace_id_lo=lo,
                                                 attributes_json=attributes).SerializeToString()])
    assert err is None and acks[0].accepted == 6
    return collector.store


def test_trace_takes_any_unique_prefix_in_any_case(three_traces, tmp_path):
    report = crosstrace("report", "--store", three_traces, "--trace", "ABCE", "--json", "-")
    assert report.returncode == 0, report.stderr
    assert [t["trace_id"] for t in json.loads(report.stdout)["traces"]] == ["abce" + "0" * 12 + "3" + "0" * 15]
    shown = "abcd000000000001"   # what the terminal shows: 16 digits, here the high half of A and B
    result = crosstrace("report", "--store", three_traces, "--trace", shown + "2", "--json", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    assert "1 trace asked for, analysed among all 3" in result.stderr
    assert [t["trace_id"] for t in json.loads((tmp_path / "r.json").read_text())["traces"]] == \
        ["abcd" + "0" * 11 + "12" + "0" * 15]
    assert one_line_error(crosstrace("report", "--store", three_traces, "--trace", shown), shown, "ambiguous")
    assert one_line_error(crosstrace("report", "--store", three_traces, "--trace", "ffff"), "'ffff'")
    assert one_line_error(crosstrace("report", "--store", three_traces, "--trace", "xyz"), "'xyz'")
    export_ = crosstrace("export", "--store", three_traces, "--trace", "abce", "--jsonl", "-")
    assert export_.returncode == 0 and len(export_.stdout.splitlines()) == 2, export_.stderr
    assert one_line_error(crosstrace("export", "--store", three_traces, "--trace", "ab", "--jsonl", "-"), "'ab'")


def test_export_to_stdout_keeps_integers_beyond_64_bits(three_traces, tmp_path):
    result = crosstrace("export", "--store", three_traces, "--jsonl", "-", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 6 and [r["attributes"].get("big") for r in rows].count(BIG) == 1
    assert "wrote 6 spans to stdout" in result.stderr
    result = crosstrace("export", "--store", three_traces, "--perfetto", "-", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    spans = [e for e in json.loads(result.stdout)["traceEvents"] if e["ph"] == "X" and "span_id" in e["args"]]
    assert [e["args"].get("attributes", {}).get("big") for e in spans].count(BIG) == 1
    assert not os.path.exists(tmp_path / "-")


def test_paths_that_are_not_stores_are_one_line_errors(tmp_path):
    (tmp_path / "notes.txt").write_text("not a store\n")
    (tmp_path / "empty.db").touch()
    (tmp_path / "folder").mkdir()
    with sqlite3.connect(tmp_path / "other.db") as other:
        other.execute("CREATE TABLE t (x)")
    budget = tmp_path / "b.toml"
    budget.write_text('[[budget]]\nmax = "1s"\n')
    for name, what in (("notes.txt", "not a database"), ("empty.db", "empty"), ("folder", "directory"),
                       ("other.db", "not a crosstrace store")):
        path = str(tmp_path / name)
        for command in (["report"], ["clocks"], ["export", "--jsonl", "-"],
                        ["budget", "check", "--budget", str(budget)]):
            assert one_line_error(crosstrace(*command, "--store", path), path, what), (command, name)
        if name != "empty.db":   # a collector makes an empty file a store
            assert one_line_error(crosstrace("collector", "--listen", "127.0.0.1:0", "--store", path), path, what)
    with sqlite3.connect(tmp_path / "other.db") as other:   # the collector left it alone
        assert other.execute("SELECT name FROM sqlite_master").fetchall() == [("t",)]


def test_reading_commands_read_a_read_only_copy(three_traces):
    run_as = ()
    if os.geteuid() == 0:   # root writes anywhere: run the commands as nobody
        if not shutil.which("setpriv"):
            pytest.skip("running as root, without setpriv to run as another user")
        run_as = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    folder = tempfile.mkdtemp(prefix="crosstrace-ro-")
    try:
        copy = os.path.join(folder, "store.db")
        with sqlite3.connect(three_traces) as source, sqlite3.connect(copy) as target:
            source.backup(target)
        os.chmod(copy, 0o444)
        os.chmod(folder, 0o555)
        result = crosstrace("export", "--store", copy, "--jsonl", "-", run_as=run_as)
        assert result.returncode == 0 and len(result.stdout.splitlines()) == 6, result.stderr
        result = crosstrace("clocks", "--store", copy, "--json", run_as=run_as)
        assert result.returncode == 0 and "raw" in json.loads(result.stdout)["clocks"], result.stderr
        result = crosstrace("collector", "--listen", "127.0.0.1:0", "--store", copy, run_as=run_as)
        assert one_line_error(result, copy, "not writable")
        assert os.listdir(folder) == ["store.db"]
    finally:
        os.chmod(folder, 0o755)
        shutil.rmtree(folder)


def test_collector_listen_address_is_checked(tmp_path):
    store = str(tmp_path / "store.db")
    for listen, words in (("127.0.0.1:99999", ["99999", "out of range"]), ("127.0.0.1:-5", ["HOST:PORT"]),
                          ("localhost", ["HOST:PORT", "'localhost'"]), ("127.0.0.1:", ["HOST:PORT"])):
        assert one_line_error(crosstrace("collector", "--listen", listen, "--store", store), *words), listen
    assert not os.path.exists(store)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        result = crosstrace("collector", "--listen", listen, "--store", store)
    assert result.returncode == 2 and result.stderr == f"crosstrace: error: cannot listen on {listen}: " \
        "Address already in use\n"             # and no raw gRPC log line
    assert os.listdir(tmp_path) == []          # nor a store left behind


def test_report_limit_must_be_positive(tmp_path):
    result = crosstrace("report", "--store", str(tmp_path / "s.db"), "--limit", "-1")
    assert result.returncode == 2 and "argument --limit: must be 1 or more, got -1" in result.stderr


@pytest.mark.parametrize("command,value,message", [
    ("report", "1e400s", "is not a duration like 90s"), ("clocks", "5x", "is not a duration like 90s"),
    ("collector", "300000d", "must be more than 0 and at most 100 years"),
    ("export", "0s", "must be more than 0")])   # it was "not a duration", which 0s is
def test_durations_are_checked_where_they_are_given(tmp_path, command, value, message):
    """An infinite --last raised OverflowError, and a --retain of 800 centuries passed the
    parser and stopped the collector at its first tick (beyond SQLite's integers)."""
    option = "--retain" if command == "collector" else "--last"
    result = crosstrace(command, "--store", str(tmp_path / "s.db"), option, value)
    assert result.returncode == 2 and f"{value!r} {message}" in result.stderr, result.stderr


def test_report_of_many_nodes_lists_the_ones_to_look_at(collector):
    """40 nodes, 14 of them dropping spans: the terminal lists 16 clocks and 8 dropping nodes
    (most dropped first), and says where the rest are."""
    messages = []
    for i in range(40):
        b = batch(1, node=f"rank-{i:02d}", first_id=i + 1, dropped_spans=100 + i if i % 3 == 0 else 0)
        b.session_id = i.to_bytes(16, "little")
        messages.append(b.SerializeToString())
    acks, err = export(collector.address, messages)
    assert err is None and len(acks) == 40
    result = crosstrace("report", "--store", collector.store)
    assert result.returncode == 0, result.stderr
    clock_rows = re.findall(r"^│ (rank-\d\d)", result.stdout, re.MULTILINE)
    assert len(clock_rows) == 16 and "16 of 40 nodes" in result.stdout
    assert "... and 24 more nodes: `crosstrace clocks` or --json" in result.stdout
    dropped = " ".join(result.stdout[result.stdout.index("dropped spans"):].split())
    assert re.findall(r"rank-\d\d", dropped.split(" and ")[0]) == [f"rank-{i:02d}" for i in (39, 36, 33, 30, 27, 24, 21, 18)]
    assert "and 6 more nodes (1,673 in all)" in dropped
    clocks = crosstrace("clocks", "--store", collector.store)
    assert len(re.findall(r"^│ rank-\d\d", clocks.stdout, re.MULTILINE)) == 40


def test_clock_table_puts_flagged_nodes_and_wide_bounds_first():
    from rich.console import Console
    from crosstrace.collector.views.terminal import render_clocks

    def clock(bound, flags=()):
        return {"offset_ns": 0, "drift_ppm": 0.0, "error_bound_ns": bound, "drift_bound_ppm": None, "samples": 3,
                "sources": ["udp"], "flags": list(flags)}
    clocks = {f"n{i:02d}": clock(1000 + i) for i in range(30)}
    clocks.update(n05=clock(10, ["outliers"]), n06=clock(None), n07=clock(50, ["clock_step"]))
    console = Console(record=True, width=120)
    render_clocks(clocks, console, rows=5)
    shown = re.findall(r"^│ (n\d\d)", console.export_text(), re.MULTILINE)
    assert shown == ["n07", "n05", "n06", "n29", "n28"]   # flagged (widest first), unknown bound, widest
    render_clocks(dict(list(clocks.items())[:5]), console := Console(record=True, width=120), rows=5)
    assert re.findall(r"^│ (n\d\d)", console.export_text(), re.MULTILINE) == ["n00", "n01", "n02", "n03", "n04"]


def test_names_with_square_brackets_are_shown_as_they_are(collector):
    """rich reads `[...]` as markup: a span named after a module path with `[/3]` crashed
    the report, and `fwd[stage1]` lost its brackets."""
    run_python("""
        import crosstrace
        provider = crosstrace.init()
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("fwd[stage1]"):
            with tracer.start_as_current_span("encoder.layers[/3]", kind=crosstrace.Kind.COMPUTE):
                pass
        provider.shutdown()
    """, tracer_env(collector, "edge[/dev0]"))
    for command in ("report", "clocks"):
        result = crosstrace(command, "--store", collector.store, run_as=("env", "COLUMNS=200"))
        assert result.returncode == 0, result.stderr
        assert "edge[/dev0]" in result.stdout
    report = crosstrace("report", "--store", collector.store, run_as=("env", "COLUMNS=200"))
    assert "fwd[stage1]" in report.stdout and "encoder.layers[/3]" in report.stdout


def test_children_run_the_installed_package_wherever_they_start(tmp_path, monkeypatch):
    """From a clone of the repository (the README's quick start, a plain install), `python -m
    crosstrace` in the collector and the demo's workers found the clone's `crosstrace` folder
    first, which lacks its subpackages there: the demo stopped at its collector."""
    from crosstrace.demo.workers import Workers
    from crosstrace.launch import CollectorProcess

    shadow = tmp_path / "crosstrace"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the folder where the command runs')\n")
    monkeypatch.chdir(tmp_path)
    with CollectorProcess(str(tmp_path / "s.db")) as collector:
        workers = Workers(collector, 0)
        try:
            assert workers.start(["-c", "import crosstrace.proto; print('listening on', crosstrace.__name__)"],
                                 dict(os.environ), wait_listening=True) == "crosstrace"
        finally:
            for proc in workers.procs:
                proc.wait(30)


def test_piped_report_is_not_cut_to_80_columns(rpc_store):
    """rich lays a report out 80 columns wide where stdout is no terminal (a file, a pipe, a
    CI log), and cut its tables' cells short ("…")."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    result = subprocess.run([sys.executable, "-m", "crosstrace", "report", "--store", rpc_store],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout and max(map(len, result.stdout.splitlines())) > 80


def test_outputs_that_cannot_be_written_are_refused_before_the_analysis(rpc_store, tmp_path):
    """A typo in an output's folder failed with a raw Errno once the analysis was done."""
    for args, words in ((("report", "--json", str(tmp_path / "typo" / "r.json")), ["there is no folder"]),
                        (("export", "--perfetto", str(tmp_path)), ["is a folder"]),
                        (("budget", "check", "--budget", "b.toml", "--json", str(tmp_path / "no" / "b.json")),
                         ["there is no folder"])):
        result = crosstrace(*args, "--store", rpc_store)
        assert one_line_error(result, "cannot write", *words), result.stderr
        assert "loading spans" not in result.stderr                  # refused before the analysis
    # An OTLP header without --otlp was ignored, silently.
    result = crosstrace("export", "--jsonl", str(tmp_path / "s.jsonl"), "--otlp-header", "a=b", "--store", rpc_store)
    assert one_line_error(result, "--otlp-header goes with --otlp") and not (tmp_path / "s.jsonl").exists()
    result = crosstrace("export", "--jsonl", str(tmp_path / "s.jsonl"), "--otlp-ca", "ca.pem", "--store", rpc_store)
    assert one_line_error(result, "--otlp-ca goes with --otlp") and not (tmp_path / "s.jsonl").exists()
    result = crosstrace("export", "--otlp", "nohost", "--store", rpc_store)   # refused before the analysis
    assert one_line_error(result, "--otlp nohost: expected HOST:PORT") and "loading spans" not in result.stderr


def test_a_demo_leaves_a_store_that_a_collector_is_writing_alone(three_traces):
    """The demo replaces its --out folder's store: it once deleted a running collector's
    store (its spans gone, the collector writing to a removed file), then failed on its lock
    with a traceback."""
    out = os.path.dirname(three_traces)
    result = crosstrace("demo", "--out", out, "--workloads", "rpc", "--requests", "1", timeout=120)
    assert one_line_error(result, "in use by another collector", "--out"), result.stderr
    assert "Traceback" not in result.stderr
    report = crosstrace("report", "--store", three_traces, "--json", "-")
    assert report.returncode == 0, report.stderr
    assert len(json.loads(report.stdout)["traces"]) == len(TRACES)


def test_a_report_of_some_traces_lists_their_nodes_clocks_only(collector):
    """Another node's clock says nothing of the trace asked for; the whole store's report lists both."""
    acks, err = export(collector.address, [batch(2, node="edge", trace_hi=1).SerializeToString(),
                                           batch(2, seq=2, node="cloud", trace_hi=2, first_id=5).SerializeToString()])
    assert err is None and [a.accepted for a in acks] == [2, 2]
    whole = crosstrace("report", "--store", collector.store, "--json", "-")
    assert whole.returncode == 0, whole.stderr
    assert sorted(json.loads(whole.stdout)["clocks"]) == ["cloud", "edge"]
    one = crosstrace("report", "--store", collector.store, "--trace", f"{1:016x}", "--json", "-")
    assert one.returncode == 0, one.stderr
    assert list(json.loads(one.stdout)["clocks"]) == ["edge"]


def test_an_empty_store_says_so_on_the_page(tmp_path):
    """The HTML page of a store without traces was a legend and a clock table, and nothing said why."""
    from crosstrace.collector.store import Store

    Store(str(tmp_path / "empty.db")).close()
    result = crosstrace("report", "--store", str(tmp_path / "empty.db"), "--html", str(tmp_path / "r.html"))
    assert result.returncode == 0, result.stderr
    assert "No traces in this store" in (tmp_path / "r.html").read_text()


def test_traces_asked_for_read_as_in_the_whole_report(demo, tmp_path):
    """A pipeline rank's window in a step ends where its previous and next steps begin: read
    alone, every step of the demo's pipeline had other per-rank numbers than the whole
    store's report (stage-1's bubble 79.9 against 59.5 ms in one). Traces asked for are
    analysed among the store's now and shown alone, steps and an RPC trace alike: their
    nodes' clocks, their unmatched operations, their own spans in a budget of spans (a
    step's 8 forwards, not all steps' 72)."""
    out, _ = demo
    store = str(out / "store.db")
    whole = json.loads((out / "report.json").read_text())
    steps = [t for t in whole["traces"] if t["pipeline"]]
    rpc = [t for t in whole["traces"] if "frontend" in t["per_rank"]]
    assert len(steps) >= 2 and rpc
    asked = steps[:2] + rpc[:1]
    result = crosstrace("report", "--store", store, *(a for t in asked for a in ("--trace", t["trace_id"])),
                        "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(t["trace_id"] for t in report["traces"]) == sorted(t["trace_id"] for t in asked)
    alone = {t["trace_id"]: t for t in report["traces"]}
    for trace in asked:
        for key in ("start_ns", "duration_ns", "per_rank", "attribution", "critical_path", "pipeline", "straggler",
                    "collectives", "unmatched"):
            assert alone[trace["trace_id"]][key] == trace[key], (trace["name"], key)
    assert sorted(report["clocks"]) == sorted({node for t in asked for node in t["per_rank"]})
    unmatched = collections.Counter()
    for trace in asked:
        unmatched.update(trace["unmatched"])
    assert {k: v for k, v in report["unmatched"].items() if v} == dict(unmatched)
    step = steps[0]["trace_id"]
    spans = crosstrace("export", "--store", store, "--trace", step, "--jsonl", "-")
    forwards = sum(json.loads(line)["name"] == "forward" for line in spans.stdout.splitlines())
    (tmp_path / "b.toml").write_text('[[budget]]\nspan = "forward"\npercentile = 50\nmax = "1h"\n')
    budget = crosstrace("budget", "check", "--store", store, "--trace", step, "--budget", str(tmp_path / "b.toml"),
                        "--json", "-")
    assert budget.returncode == 0, budget.stderr
    assert forwards > 0 and json.loads(budget.stdout)[0]["samples"] == forwards
