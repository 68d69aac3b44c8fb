"""`crosstrace report --html`: the page opens in a real headless Chromium (Debian packages
chromium and chromium-driver, driven with selenium) without console errors, fetches
nothing, and shows one lane per node, the critical path, working legend toggles, and the
segments of each kind of trace at p50/p95/p99."""
import os
import shutil
import subprocess
import sys

import pytest

from crosstrace.collector.attribution import attribute
from crosstrace.collector.matching import match
from crosstrace.collector.report import Analysed, trace_details, trace_summaries
from crosstrace.collector.views import html
from crosstrace.proto.semconv import Kind

from .test_analysis_units import Spans, build, gpipe, straggler_step

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs the Debian packages chromium and chromium-driver")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver import ChromeOptions, ChromeService

    options = ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    yield driver
    driver.quit()


def open_page(browser, path) -> None:
    browser.get(f"file://{path}")
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    assert errors == []
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0


def lanes(browser, timeline: int = 0) -> list[tuple[str, float]]:
    """(node, width in px) of each lane of a timeline."""
    return browser.execute_script("""
        const svg = document.querySelectorAll('svg.timeline')[arguments[0]];
        return [...svg.querySelectorAll('g.lane')].map(
            g => [g.dataset.node, g.getBoundingClientRect().width]);""", timeline)


def hand_built_page(tmp_path, spans, nodes) -> str:
    table, alignment = build(spans, nodes)
    analysed = Analysed(table, alignment, match(table))
    at = attribute(table, alignment, analysed.matches)
    traces = trace_summaries(analysed)
    index = {trace_id: i for i, trace_id in enumerate(table.trace_ids)}
    details = trace_details(table, at)
    for trace in traces:
        trace.update(details[index[trace["trace_id"]]])
    report = {"store": "hand-built", "traces": traces, "budgets": [], "unmatched": {}}
    path = tmp_path / "report.html"
    html.write(str(path), report, analysed, at)
    return str(path)


def test_lanes_critical_path_and_legend(browser, tmp_path):
    spans, nodes = straggler_step()
    more, _ = gpipe()
    for s in more:
        s["trace"] = 2
    path = hand_built_page(tmp_path, spans + more, {**nodes, "stage0": 0, "stage1": 1})
    open_page(browser, path)
    assert sorted(node for node, _ in lanes(browser)) == ["rank0", "rank1", "rank2"]   # the slowest trace
    assert all(width > 500 for _, width in lanes(browser))
    assert sorted(node for node, _ in lanes(browser, 1)) == ["stage0", "stage1"]       # the other one
    points = browser.execute_script(
        "return document.querySelector('svg.timeline polyline.critical').getAttribute('points')")
    assert len(points.split()) >= 4
    body = browser.find_element("tag name", "body").text
    assert "Straggler: rank2 (rank 2), busy in backward" in body
    assert "bubble 20.0% (ideal 20.0% for 2 ranks, 4 microbatches)" in body

    visible = "return [...document.querySelectorAll('svg .cat-compute')].filter(e => e.getBoundingClientRect().width > 0).length"
    shown = browser.execute_script(visible)
    assert shown > 0
    browser.find_element("css selector", '.legend span[data-cat="cat-compute"]').click()
    assert browser.execute_script(visible) == 0
    browser.find_element("css selector", '.legend span[data-cat="cat-compute"]').click()
    assert browser.execute_script(visible) == shown
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_report_command_writes_the_page(browser, rpc_store, tmp_path):
    budget = tmp_path / "budget.toml"
    budget.write_text('[[budget]]\ncategory = "network.uplink"\npercentile = 95\nmax = "1us"\n')
    page = tmp_path / "report.html"
    result = subprocess.run([sys.executable, "-m", "crosstrace", "report", "--store", rpc_store, "--html", str(page),
                             "--budget", str(budget)], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    text = page.read_text()
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    assert "1 of 1 budgets violated" in text    # the verdict the terminal prints
    open_page(browser, page)
    assert sorted(node for node, _ in lanes(browser)) == ["frontend", "gateway", "model"]
    row = browser.find_element("css selector", "td.violated")
    assert row.text == "violated"
    # The traces of one kind, summarised: every critical-path segment at p50/p95/p99.
    segments = browser.find_elements("css selector", "table.kind tr")
    assert len(segments) >= 3 and "(network.uplink)" in browser.find_element("css selector", "table.kind").text
    # Each node's recovered clock, as the terminal report shows them.
    clocks = browser.find_element("xpath", "//h2[starts-with(., 'clocks')]/following-sibling::table[1]").text
    assert all(node in clocks for node in ("frontend", "gateway", "model")) and "ppm" in clocks


def test_each_kind_of_trace_gets_a_timeline(browser, tmp_path):
    """The slowest and the median of all traces mixed (a pipeline step and a request) hid
    the training step and its straggler: each kind's slowest trace is drawn, the slowest
    kind first. A span with children is drawn faint (its colour is its own time's: a step
    solid in bubble read as all bubble), and a lane's label keeps its end, the rank."""
    spans, nodes = straggler_step()
    more, _ = gpipe()
    for s in more:
        s["trace"] = 2
        if s["parent"] == 0:
            s["name"] = "pipeline-step"
    host = "ip-10-0-12-34.us-west-2.compute.internal/rank"
    for s in spans:
        s["node"] = host + s["node"][-1]
    path = hand_built_page(tmp_path, spans + more, {**{host + str(r): r for r in range(3)}, "stage0": 0, "stage1": 1})
    open_page(browser, path)
    titles = browser.execute_script("return [...document.querySelectorAll('section.trace h2')].map(h => h.textContent)")
    assert [title.split(":")[0] for title in titles] == ["slowest of 1 trace of its kind"] * 2
    assert [title.split(": ")[1].split(" ")[0] for title in titles] == ["step", "pipeline-step"]   # slowest first
    labels = browser.execute_script(
        "return [...document.querySelectorAll('svg.timeline')[0].querySelectorAll('.lane-label')].map(t => t.textContent)")
    assert labels[1:] == [f"ip-10-0-12-…rank{r} (rank {r})" for r in range(3)]   # not 3 x "ip-10-0-12-34.us-west-2.co"
    faint = browser.execute_script("""
        return [...document.querySelectorAll('svg.timeline')[0].querySelectorAll('rect')]
            .filter(r => r.getAttribute('fill-opacity') === '0.3')
            .map(r => r.querySelector('title').textContent.split(' ')[0]);""")
    assert sorted(set(faint)) == ["step"]   # the roots: their children cover them


def drawn_spans(browser) -> list[tuple[str, float, float, float]]:
    """(name, left x, right x, top y) of each span drawn in the first timeline's lanes (not
    the critical path's strip above them, nor the wait/transfer parts drawn over spans)."""
    return browser.execute_script("""
        return [...document.querySelector('svg.timeline').querySelectorAll('rect')].filter(r => r.querySelector('title')
                && +r.getAttribute('height') === arguments[0] && +r.getAttribute('y') > 20)
            .map(r => [r.querySelector('title').textContent.split(' ')[0], +r.getAttribute('x'),
                       +r.getAttribute('x') + +r.getAttribute('width'), +r.getAttribute('y')]);""", html.ROW - 2)


def test_concurrent_spans_of_a_node_get_rows_of_their_own(browser, tmp_path):
    """Two requests a server handles at once, on two threads, each with its own child: by
    nesting depth alone the two requests shared a row, and so did their children, drawn
    over each other. No two spans of a lane overlap now, each child is below its parent,
    and a lane has the rows it needs (the server's 4, the client's 3)."""
    s = Spans()
    call_a = s.add("call-a", Kind.RPC_CLIENT, 0, 60, "client")
    call_b = s.add("call-b", Kind.RPC_CLIENT, 4, 70, "client", thread=2)
    a = s.add("request-a", Kind.RPC_SERVER, 2, 55, "server", call_a)
    s.add("infer-a", Kind.COMPUTE, 10, 40, "server", a)
    b = s.add("request-b", Kind.RPC_SERVER, 6, 65, "server", call_b, thread=2)
    s.add("infer-b", Kind.COMPUTE, 20, 60, "server", b, thread=2)
    # A child that says an earlier start than its parent's (OpenTelemetry lets it: a span
    # dated back to when its work was queued), and one that starts with it and ends later:
    # placed by start alone, each was drawn above its parent.
    c = s.add("request-c", Kind.RPC_SERVER, 72, 80, "server", thread=3)
    s.add("queued-c", Kind.INTERNAL, 68, 76, "server", c, thread=3)
    s.add("tail-c", Kind.INTERNAL, 72, 84, "server", c, thread=3)
    root = s.add("batch", Kind.INTERNAL, 0, 80, "client", thread=3)
    for span in s.spans:
        if span["id"] in (call_a, call_b):
            span["parent"] = root
    open_page(browser, hand_built_page(tmp_path, s.spans, {"client": -1, "server": -1}))
    drawn = drawn_spans(browser)
    spans = {name: (x0, x1, y) for name, x0, x1, y in drawn}
    assert len(spans) == len(s.spans) == len(drawn)
    for one, (x0, x1, y) in spans.items():
        for other, (u0, u1, v) in spans.items():
            if one != other and y == v:
                assert x1 <= u0 + 0.01 or u1 <= x0 + 0.01, (one, other)
    for child, parent in (("infer-a", "request-a"), ("infer-b", "request-b"), ("call-a", "batch"), ("call-b", "batch"),
                          ("queued-c", "request-c"), ("tail-c", "request-c")):
        assert spans[child][2] > spans[parent][2], (child, parent)
    heights = dict(browser.execute_script("""
        return [...document.querySelector('svg.timeline').querySelectorAll('g.lane')].map(
            g => [g.dataset.node, +g.querySelector('rect').getAttribute('height')]);"""))
    assert (heights["client"], heights["server"]) == (3 * html.ROW + 6, 4 * html.ROW + 6)   # and a margin


def test_a_lane_of_many_concurrent_spans_keeps_its_last_row_for_the_rest(browser, tmp_path):
    """Twelve requests at once on one node: a lane has MAX_ROWS rows, and the spans beyond
    them share the last, rather than a lane as tall as the burst."""
    s = Spans()
    for k in range(12):
        s.add(f"request-{k}", Kind.RPC_SERVER, k, 50 + k, "server", thread=k + 1)
    open_page(browser, hand_built_page(tmp_path, s.spans, {"server": -1}))
    rows = [y for _, _, _, y in drawn_spans(browser)]
    assert len(rows) == 12 and len(set(rows)) == html.MAX_ROWS
    assert sorted(rows)[-(12 - html.MAX_ROWS + 1):] == [max(rows)] * (12 - html.MAX_ROWS + 1)
