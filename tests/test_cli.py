"""The command line as users run it: demo, report (terminal and JSON), export, help."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from crosstrace.demo import injected_offset_at

from .conftest import run_python, tracer_env


def crosstrace(*args, timeout=300, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "crosstrace", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


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
    out, _ = demo
    report = json.loads((out / "report.json").read_text())
    ddp = report["demo"]["workloads"]["ddp"]
    steps = [t for t in report["traces"] if "trainer-0" in t["per_rank"]]
    assert len(steps) == ddp["steps"]
    named = [t["straggler"]["node"] for t in steps if t["straggler"]]
    assert named.count(ddp["straggler_node"]) >= len(steps) // 2, named


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
                            "start_ns", "end_ns", "error_bound_ns", "attributes"}
    by_id = {r["span_id"]: r for r in rows}
    # Aligned: every RPC server span lies inside its client span despite offsets of hundreds of ms.
    for r in rows:
        if r["kind"] == "RPC_SERVER":
            client = by_id[r["parent_span_id"]]
            slack = r["error_bound_ns"] + client["error_bound_ns"]
            assert client["start_ns"] - slack <= r["start_ns"] and r["end_ns"] <= client["end_ns"] + slack


def test_help_answers_and_errors_are_clear(tmp_path):
    result = crosstrace("--help")
    assert result.returncode == 0 and "demo" in result.stdout and "collector" in result.stdout
    result = crosstrace("report", "--store", str(tmp_path / "missing.db"))
    assert result.returncode == 2 and "no crosstrace store at" in result.stderr


def test_collector_cli_stops_cleanly_on_sigterm(collector):
    run_python("""
        import crosstrace
        p = crosstrace.init()
        with p.get_tracer("t").start_as_current_span("x"):
            pass
        assert p.force_flush(10000)
    """, env=tracer_env(collector, "cli"))
    assert collector.stop() == 0


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


def test_a_terminated_demo_stops_its_collector_and_workers(tmp_path):
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
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 143
        assert "interrupted" in demo.stdout.read()
        deadline = time.monotonic() + 20
        while (_processes_mentioning(f"CROSSTRACE_ENDPOINT={address}") or _processes_mentioning(str(tmp_path))) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _processes_mentioning(f"CROSSTRACE_ENDPOINT={address}")
        assert not _processes_mentioning(str(tmp_path / "store.db"))
    finally:
        killer.cancel()
        demo.kill()
