"""Latency budgets: the TOML schema, measuring them on traces with known numbers, and
`crosstrace budget check` as a CI gate on a real store."""
import json
import os
import subprocess
import sys

import pytest

from crosstrace.collector import budgets
from crosstrace.collector.attribution import attribute
from crosstrace.collector.durations import format_ns, format_within
from crosstrace.collector.views.summaries import format_measured, format_worst
from crosstrace.collector.matching import match
from crosstrace.collector.report import trace_details
from crosstrace.commands.report import duration
from crosstrace.proto.semconv import Kind

from .test_analysis_units import MS, Spans, build, straggler_step


def parse(text: str, tmp_path) -> list:
    path = tmp_path / "budget.toml"
    path.write_text(text)
    return budgets.load(str(path))


def test_schema_and_rules(tmp_path):
    parsed = parse("""
[[budget]]
span = "preprocess"
node = "edge*"
percentile = 99
max = "5ms"

[[budget]]
name = "uplink"
category = "network.uplink"
percentile = 95
max = "20ms"

[[budget]]
category = "collective.wait"
traces = "step"
max = "10%"

[[budget]]
traces = "request"
max = "1.5s"
""", tmp_path)
    assert [b.rule for b in parsed] == ["edge*.preprocess p99 <= 5ms", "network.uplink p95 <= 20ms",
                                        "collective.wait <= 10% of step (worst_rank)", "duration <= 1.5s in request"]
    assert parsed[1].name == "uplink" and parsed[0].name == parsed[0].rule
    assert (parsed[0].limit, parsed[0].share) == (5e6, False)
    assert (parsed[2].limit, parsed[2].share, parsed[2].measure) == (0.1, True, "worst_rank")
    assert parsed[3].limit == 1.5e9 and parsed[3].percentile == 100
    assert budgets.parse_limit("250us") == (250e3, False) and budgets.parse_limit("800 ns") == (800, False)
    assert budgets.parse_limit("2min") == (120e9, False)        # one grammar with --last and --retain
    assert duration("250us") == 250_000 and duration("1.5h") == 5_400 * 10**9


def test_durations_print_as_people_read_them():
    assert [format_ns(ns) for ns in (950, 28_400_000, 999_999, 999_999_999, None)] == \
        ["950 ns", "28.4 ms", "1 ms", "1 s", "-"]
    assert format_ns(5e6, 12, sep="") == "5ms" and format_ns(60_000_001, 8) == "60.000001 ms"
    # an offset to the digit its error bound reaches: 3 s off by 161 us, known to 6 us
    assert format_within(3_000_161_413, 5_930) == "3.000161 s" and format_within(-35e6, 3_920) == "-35.000 ms"
    assert format_within(250e6, None) == "250 ms"
    assert format_ns(999.6, 4, sep="") == "1us" and format_within(999_999_999.7, 1_000) == "1.000000 s"


@pytest.mark.parametrize("text,message", [
    ('[[budget]]\nspan = "x"\n', "missing max"),
    ('[[budget]]\nspan = "x"\nmax = "5 parsecs"\n', "expected a time"),
    ('[[budget]]\nspan = "x"\nmax = 5\n', "expected a time"),
    ('[[budget]]\ncategory = "netwrk"\nmax = "5ms"\n', "expected one of compute"),
    ('[[budget]]\nspan = "x"\ncategory = "data"\nmax = "5ms"\n', "not both"),
    ('[[budget]]\nnode = "edge"\nmax = "5ms"\n', "node only applies"),
    ('[[budget]]\nspan = "x"\nmeasure = "worst_rank"\nmax = "5ms"\n', "measure only applies"),
    ('[[budget]]\ncategory = "data"\nmeasure = "best"\nmax = "5ms"\n', "expected one of critical_path"),
    ('[[budget]]\nspan = "x"\npercentile = 120\nmax = "5ms"\n', "percentile"),
    ('[[budget]]\nspan = "x"\nmax = "5ms"\ncolour = "red"\n', "unknown keys colour"),
    ('[[budget]]\nspan = ""\nmax = "5ms"\n', "span is empty"),   # it read as a trace-duration rule
    ('[budget]\nspan = "x"\n', "expected one or more [[budget]] tables"),
    ('budgets = 3\n', "unknown top-level keys: budgets"),
    ('[[budget]\n', "not valid TOML"),
    ('[[budget]]\ncategory = "data"\nmax = "150%"\n', "at most 100%"),   # it held whatever happened
    ('[[budget]]\ncategory = "collective.wait"\nmeasure = "critical_path"\nmax = "1ms"\n',
     "never on the critical path"),   # it measured 0 and held whatever happened
])
def test_bad_files_say_what_and_where(tmp_path, text, message):
    with pytest.raises(budgets.BudgetError, match=message.replace("[", r"\[")) as info:
        parse(text, tmp_path)
    assert "budget.toml" in str(info.value)


def evaluate(spans, nodes, text, tmp_path, errors_ms=None):
    table, alignment = build(spans, nodes, errors_ms)
    at = attribute(table, alignment, match(table))
    details = trace_details(table, at)
    traces = [{"trace_id": table.trace_ids[i], "name": "step", "duration_ns":
               int(at.dag.trace_end[i] - at.dag.trace_start[i]), **details[i]} for i in range(len(details))]
    return budgets.evaluate(parse(text, tmp_path), traces, table, at)


def test_measured_values_on_known_traces(tmp_path):
    spans, nodes = straggler_step(late_ms=50)
    more = Spans(trace=2)
    for r in range(3):
        root = more.add("step", Kind.INTERNAL, 0, 50, f"rank{r}")
        more.add("backward", Kind.COMPUTE, 1, 40 + r, f"rank{r}", root)
    results = evaluate(spans + more.spans, nodes, """
[[budget]]
span = "backward"
node = "rank2"
max = "50ms"

[[budget]]
span = "backward"
percentile = 50
max = "30ms"

[[budget]]
category = "collective.wait"
max = "40%"

[[budget]]
category = "compute"
max = "80ms"

[[budget]]
span = "no such span"
max = "1ms"
""", tmp_path)
    by_rule = {r["rule"]: r for r in results}
    rank2 = by_rule["rank2.backward <= 50ms"]
    assert (rank2["samples"], rank2["measured"], rank2["status"]) == (2, 60 * MS, "violated")
    assert rank2["worst"][0]["value"] == 60 * MS and rank2["worst"][0]["node"] == "rank2"   # whom to ask
    assert format_worst(rank2).startswith("0000000000000000 (60 ms on rank2), ")
    median = by_rule["backward p50 <= 30ms"]
    assert median["samples"] == 6 and median["measured"] == 39 * MS and not median["ok"]   # 10 10 [39] 40 41 60
    wait = by_rule["collective.wait <= 40% (worst_rank)"]
    assert wait["measured"] == pytest.approx(0.5) and wait["status"] == "violated"   # 50 of 100 ms
    compute = by_rule["compute <= 80ms"]
    assert compute["ok"] and compute["measured"] == 79 * MS                           # on the critical path
    assert by_rule["no such span <= 1ms"]["status"] == "no_data" and not by_rule["no such span <= 1ms"]["ok"]


def test_a_category_is_sampled_in_the_traces_that_can_have_it(tmp_path):
    """A trace without collectives has no collective time: counted as a 0, it passed a
    median that the one step with collectives violates. Every trace has host.overhead."""
    spans, nodes = straggler_step(late_ms=50)
    more = Spans(trace=2)
    root = more.add("request", Kind.INTERNAL, 0, 50, "rank0")
    more.add("preprocess", Kind.COMPUTE, 1, 40, "rank0", root)
    results = evaluate(spans + more.spans, nodes, """
[[budget]]
category = "collective.transfer"
percentile = 50
max = "1ms"

[[budget]]
category = "network.uplink"
max = "1ms"

[[budget]]
category = "host.overhead"
max = "1s"
""", tmp_path)
    transfer, uplink, overhead = results
    assert (transfer["samples"], transfer["measured"], transfer["status"]) == (1, 9 * MS, "violated")
    assert transfer["worst"][0]["trace_id"] == f"{1:032x}"
    assert uplink["status"] == "no_data"   # no RPC anywhere: no sample, so the gate fails
    assert overhead["samples"] == 2 and overhead["ok"]


def test_a_ranks_share_is_of_its_window(tmp_path):
    """A per-rank share (the waits, bubble) is of each rank's window, as the report's
    breakdown and bubble fraction are: of the trace's duration, which includes time before
    a rank's step began, a pipeline budget of 21% passed steps whose bubble fraction was
    22-36% (a user's review). Here rank 1 joins the step at 50 ms and waits 25 of its 50."""
    from .test_analysis_units import coll

    s = Spans()
    root = s.add("step", Kind.INTERNAL, 0, 100, "rank0")
    s.add("forward", Kind.COMPUTE, 0, 80, "rank0", root)
    s.add("all_reduce", Kind.COLLECTIVE, 80, 90, "rank0", root, **coll(1, [0, 1]))
    root = s.add("step", Kind.INTERNAL, 50, 100, "rank1")
    s.add("forward", Kind.COMPUTE, 50, 55, "rank1", root)
    s.add("all_reduce", Kind.COLLECTIVE, 55, 90, "rank1", root, **coll(1, [0, 1]))
    results = evaluate(s.spans, {"rank0": 0, "rank1": 1}, """
[[budget]]
category = "collective.wait"
max = "40%"

[[budget]]
category = "collective.wait"
measure = "mean_rank"
max = "20%"
""", tmp_path)
    assert [r["measured"] for r in results] == [pytest.approx(0.5), pytest.approx(0.25)]
    assert [r["status"] for r in results] == ["violated", "violated"]
    assert results[0]["worst"][0]["node"] == "rank1" and "node" not in results[1]["worst"][0]   # the rank that waited


def test_percentiles_take_the_nearest_rank_exactly(tmp_path):
    """p99.9 of 1000 samples is the 999th smallest: numpy's float product (99.9 / 100 * 1000 =
    999.0000000000001) took the 1000th, the one outlier, and failed the gate."""
    spans = Spans()
    for i in range(1000):
        spans.add("op", Kind.COMPUTE, 0, 100 if i == 0 else 1, "n", trace=i + 1)
    [result] = evaluate(spans.spans, {"n": -1}, '[[budget]]\nspan = "op"\npercentile = 99.9\nmax = "10ms"\n',
                        tmp_path)
    assert (result["samples"], result["measured"], result["status"]) == (1000, 1 * MS, "ok")


def test_a_value_just_over_its_limit_prints_apart_from_it(tmp_path):
    """Measured 60.000001 ms against max 60 ms: the table must not show 60 ms twice beside
    VIOLATED, and the rule keeps the limit as given; a budget with no data is counted as
    such, not as violated."""
    from rich.console import Console

    from crosstrace.collector.views.terminal import render_budgets

    s = Spans()
    s.add("backward", Kind.COMPUTE, 0, 60.000001, "rank0")
    results = evaluate(s.spans, {"rank0": 0}, """
[[budget]]
span = "backward"
max = "60ms"

[[budget]]
span = "backward"
max = "59.999999ms"

[[budget]]
span = "no such span"
max = "1ms"
""", tmp_path)
    assert [r["rule"] for r in results] == ["backward <= 60ms", "backward <= 59.999999ms", "no such span <= 1ms"]
    assert format_measured(results[0]) == ("60.000001 ms", "60 ms")
    assert format_measured(results[1]) == ("60.000001 ms", "59.999999 ms")
    console = Console(record=True, width=200)
    render_budgets(results, 1, console)
    out = console.export_text()
    assert "60.000001 ms" in out and "2 of 3 budgets violated, 1 of 3 without data" in out


def crosstrace(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "crosstrace", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def test_budget_check_is_a_ci_gate(rpc_store, tmp_path):
    ok = tmp_path / "ok.toml"
    ok.write_text('[[budget]]\nspan = "preprocess"\nnode = "frontend"\npercentile = 99\nmax = "1s"\n'
                  '[[budget]]\ntraces = "request"\nmax = "10s"\n')
    result = crosstrace("budget", "check", "--store", rpc_store, "--budget", str(ok))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 2 budgets hold" in result.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text('[[budget]]\ncategory = "compute"\npercentile = 50\nmax = "1us"\n')
    result = crosstrace("budget", "check", "--store", rpc_store, "--budget", str(bad), "--json", "-")
    assert result.returncode == 1, result.stdout + result.stderr
    [entry] = json.loads(result.stdout)
    assert entry["status"] == "violated" and entry["samples"] == 8 and len(entry["worst"]) == 3
    result = crosstrace("budget", "check", "--store", rpc_store, "--budget", str(bad))
    assert result.returncode == 1 and "VIOLATED" in result.stdout and entry["worst"][0]["trace_id"][:16] in result.stdout

    broken = tmp_path / "broken.toml"
    broken.write_text('[[budget]]\ncategory = "compute"\n')
    result = crosstrace("budget", "check", "--store", rpc_store, "--budget", str(broken))
    assert result.returncode == 2 and "missing max" in result.stderr

    report = tmp_path / "report.json"
    result = crosstrace("report", "--store", rpc_store, "--budget", str(bad), "--json", str(report))
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text())["budgets"][0]["status"] == "violated"


def test_a_malformed_budget_file_is_bad_input_not_a_violation(tmp_path):
    """Exit 1 means a budget is violated (a CI gate fails on it); a budget file that is not
    one is exit 2, with one line that says why: not a traceback and exit 1."""
    import subprocess
    import sys

    store = tmp_path / "empty.db"
    from crosstrace.collector.store import Store
    Store(str(store)).close()
    for name, content in (("list.toml", b"budget = [1, 2]\n"), ("bytes.toml", b"\xff\xfe[[budget]]\n")):
        path = tmp_path / name
        path.write_bytes(content)
        out = subprocess.run([sys.executable, "-m", "crosstrace", "budget", "check", "--store", str(store),
                              "--budget", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert str(path) in out.stderr


def test_the_kinds_a_category_needs_agree_with_where_attribution_puts_time():
    """SOURCE_KINDS (the traces a category budget samples) is kept by hand beside SELF_TIME:
    a kind whose own time goes to a category must be among the kinds that category needs."""
    from crosstrace.collector.attribution import CATEGORIES, SELF_TIME, SOURCE_KINDS

    assert set(SOURCE_KINDS) <= set(CATEGORIES)
    for kind, category in SELF_TIME.items():
        if category in SOURCE_KINDS:
            assert kind in SOURCE_KINDS[category], (kind, category)
