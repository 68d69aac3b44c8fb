"""clock_sync on numbers with a known truth: bounds hold, estimates converge, changes of the
clock are found, bad sources and samples are set aside, causality leaves no violation."""
import numpy as np
import pytest

from crosstrace.clock_sync import causal, combine, exchange, geometry
from crosstrace.clock_sync.exchange import Bounds
from crosstrace.clock_sync.fit import fit


class Truth:
    """offset(r) = local - reference at reference time r, with an optional step and drift change."""

    def __init__(self, offset_ns, drift_ppm, step_at=np.inf, step_ns=0.0, change_at=np.inf, drift_after=0.0):
        self.offset, self.drift = offset_ns, drift_ppm
        self.step_at, self.step = step_at, step_ns
        self.change_at, self.drift_after = change_at, drift_after

    def theta(self, r):
        r = np.asarray(r, dtype=np.float64)
        return (self.offset + self.drift * 1e-6 * r + self.step * (r >= self.step_at)
                + (self.drift_after - self.drift) * 1e-6 * np.maximum(0.0, r - self.change_at))

    def local(self, r):
        return np.rint(np.asarray(r, dtype=np.float64) + self.theta(r)).astype(np.int64)


def exchanges(truth: Truth, seconds=300, every_s=5.0, burst=8, up_us=80, down_us=30, seed=0):
    """Bursts of two-way exchanges over an asymmetric path with exponential jitter."""
    rng = np.random.default_rng(seed)
    r1 = (np.arange(0, seconds * 1e9, every_s * 1e9)[:, None] + np.arange(burst)[None, :] * 1e6).ravel() + 1e9
    r2 = r1 + up_us * 1e3 + rng.exponential(up_us * 300, len(r1))
    r3 = r2 + 5e3
    r4 = r3 + down_us * 1e3 + rng.exponential(down_us * 300, len(r1))
    t1, t4 = truth.local(r1), truth.local(r4)
    return exchange.from_exchanges(t1, np.rint(r2), np.rint(r3), t4), r1


def coverage(model, truth: Truth, r) -> float:
    lo, hi = model.bounds_at(truth.local(r))
    true = truth.theta(r)
    return float(np.mean((lo <= true + 1) & (true - 1 <= hi)))


def test_offset_bounds_contain_offset_whatever_the_asymmetry():
    truth = Truth(5e8, 0.0)
    for up, down in ((10, 500), (500, 10), (100, 100)):
        b, r = exchanges(truth, seconds=10, up_us=up, down_us=down)
        true = truth.theta(r)
        assert np.all(b.lo <= true + 1) and np.all(true - 1 <= b.hi)
        assert np.all(b.width >= (up + down) * 1e3 - 2)


def test_hull_fit_recovers_offset_and_drift_within_its_bounds():
    truth = Truth(-7.3e8, 63.0)
    b, r = exchanges(truth, seconds=280, up_us=60, down_us=60)
    m = fit(b, "udp")
    assert m.sources == ("udp",) and m.samples == len(b) and len(m.segments) == 1
    t = truth.local(np.linspace(r[0], r[-1], 500))
    err = np.abs(m.offset_at(t) - truth.theta(np.linspace(r[0], r[-1], 500)))
    assert err.max() < 20_000                       # symmetric path: well inside one delay
    assert abs(m.drift_ppm - 63.0) < 0.2
    assert coverage(m, truth, r) == 1.0
    assert m.drift_error_ppm < 1.0 and m.error_ns < 100_000


@pytest.mark.parametrize("days", [1, 30])
def test_offsets_of_days_are_recovered_as_tightly_as_small_ones(days):
    """Monotonic clocks of two machines differ by their uptimes: days, not milliseconds.
    The estimate of such an offset was off by seconds (cancellation in the centroid)."""
    errors = []
    for offset in (-7.3e8, days * 86_400e9):
        truth = Truth(offset, 50.0)
        b, r = exchanges(truth, seconds=280, up_us=60, down_us=60)
        m = fit(b, "udp")
        t = np.linspace(r[0], r[-1], 500)
        errors.append(np.abs(m.offset_at(truth.local(t)) - truth.theta(t)).max())
        assert coverage(m, truth, r) == 1.0 and m.error_ns < 100_000
    assert errors[1] < 20_000 and errors[1] < errors[0] + 5_000, errors


def test_bounds_widen_away_from_samples_and_tighten_with_more_of_them():
    truth = Truth(1e6, -20.0)
    short = fit(exchanges(truth, seconds=20)[0])
    long = fit(exchanges(truth, seconds=200)[0])
    inside, far = short.error_at(short.span_ns[0] + 5 * 10**9), short.error_at(short.span_ns[1] + 600 * 10**9)
    assert far > 10 * inside                        # extrapolation costs the drift's uncertainty
    assert long.drift_error_ppm < short.drift_error_ppm


def test_asymmetry_is_inside_the_bound_not_removed():
    """No method can see a constant asymmetry; the bound must still cover it."""
    truth = Truth(3e7, 10.0)
    b, r = exchanges(truth, up_us=400, down_us=20)
    m = fit(b)
    assert coverage(m, truth, r) == 1.0
    err = np.abs(m.offset_at(truth.local(r)) - truth.theta(r))
    assert 150_000 < np.median(err) < 250_000        # about half the asymmetry (190 us)


def test_a_clock_step_starts_a_new_segment():
    truth = Truth(2e8, 30.0, step_at=150e9, step_ns=3e6)
    b, r = exchanges(truth)
    m = fit(b)
    assert len(m.segments) >= 2 and any(f.startswith("segments:") for f in m.flags)
    assert coverage(m, truth, r) == 1.0
    after = r > 160e9
    err = np.abs(m.offset_at(truth.local(r[after])) - truth.theta(r[after]))
    assert err.max() < 100_000


def test_a_drift_change_keeps_the_truth_inside_the_bounds():
    truth = Truth(-4e8, -50.0, change_at=140e9, drift_after=-35.0)
    b, r = exchanges(truth, seconds=300)
    m = fit(b)
    assert len(m.segments) >= 2
    assert coverage(m, truth, r) >= 0.99
    assert abs(m.drift_ppm - (-35.0)) < 1.0          # the current segment has the new drift


def test_a_lone_bad_sample_is_an_outlier_not_a_step():
    truth = Truth(0.0, 5.0)
    b, r = exchanges(truth, seconds=100)
    lo, hi = b.lo.copy(), b.hi.copy()
    lo[40] += 2e6                                     # a corrupted exchange: claims an impossible bound
    hi[40] += 2e6
    m = fit(Bounds(b.lo_t, lo, b.hi_t, hi))
    assert "outliers:1" in m.flags and len(m.segments) == 1
    assert coverage(m, truth, r) == 1.0


def test_negative_round_trips_are_dropped_and_counted():
    truth = Truth(0.0, 0.0)
    b, _ = exchanges(truth, seconds=20)
    bad = Bounds(b.lo_t, b.lo.copy(), b.hi_t, b.hi.copy())
    bad.lo[:3] = bad.hi[:3] + 1000
    m = fit(bad)
    assert "invalid_samples:3" in m.flags and m.samples == len(b)


def test_long_calls_on_a_drifting_clock_are_kept():
    """Two 10 s RPCs over a 100 us path on a clock 20 ppm slow: the upper bound (at t4)
    lies 100 us below the lower one (at t1), which drift explains; they were dropped as
    broken and the node had no model."""
    truth = Truth(3e6, -20.0)
    r1 = np.array([0.0, 30e9])
    r2 = r1 + 50e3
    r4 = r2 + 10e9 + 50e3
    b = exchange.from_exchanges(truth.local(r1), np.rint(r2), np.rint(r2 + 10e9), truth.local(r4))
    assert np.all(b.hi < b.lo)
    m = fit(b, "rpc:peer")
    assert m.known and coverage(m, truth, np.linspace(0, 40e9, 50)) == 1.0
    assert fit(exchange.from_exchanges([0], [5000], [6000], [100]), "udp").flags == ("invalid_samples:1",)


def test_polygon_extent_matches_brute_force():
    rng = np.random.default_rng(3)
    poly = geometry.box(-1e5, 1e5, 1e3)
    u, v = rng.uniform(-100, 100, 50), np.abs(rng.normal(0, 5e4, 50)) + 100  # the zero line fits
    clipped = geometry.clip_all(poly, u, v, upper=True)
    # Every line of the clipped polygon satisfies every bound...
    for a, bb in clipped:
        assert np.all(a + bb * u <= v + geometry.TOLERANCE_NS + 1e-6)
    # ...and the extent over a grid of lines from the box agrees with the vertices.
    grid_a, grid_b = np.meshgrid(np.linspace(-1e5, 1e5, 301), np.linspace(-1e3, 1e3, 301))
    ok = np.all(grid_a.ravel()[:, None] + grid_b.ravel()[:, None] * u[None, :] <= v[None, :], axis=1)
    lo, hi = geometry.extent(clipped, np.array([0.0, 50.0]))
    vals = grid_a.ravel()[ok][:, None] + grid_b.ravel()[ok][:, None] * np.array([0.0, 50.0])
    assert np.all(vals.min(axis=0) >= lo - 1) and np.all(vals.max(axis=0) <= hi + 1)


def test_hull_keeps_every_corner():
    """The union a bridge segment's bound covers: a box (two vertices at each extreme drift)
    lost a corner, and the extent shrank by 200 ns at u = -1 s."""
    rng = np.random.default_rng(5)
    box = geometry.box(-100.0, 100.0, 1e6)
    for points in (box, np.concatenate([box, rng.uniform(-50, 50, (20, 2))]),
                   np.concatenate([geometry.box(0, 10, 5), geometry.box(-3, 3, 9)])):
        ring = geometry.hull(points)
        u = np.linspace(-5, 5, 41)
        lo, hi = geometry.extent(ring, u)
        true_lo, true_hi = geometry.extent(points, u)
        assert np.allclose(lo, true_lo) and np.allclose(hi, true_hi)
    assert len(geometry.hull(box)) == 4


def test_agreeing_sources_intersect_and_a_false_one_is_flagged():
    truth = Truth(2e7, 12.0)
    udp, r = exchanges(truth, up_us=20, down_us=20, seed=1)
    grpc, _ = exchanges(truth, up_us=150, down_us=60, seed=2)
    joint = combine.combine({"udp": udp, "grpc": grpc})
    assert set(joint.sources) == {"udp", "grpc"} and not any(f.startswith("falseticker") for f in joint.flags)
    assert joint.error_ns <= fit(udp).error_ns + 1
    wrong, _ = exchanges(Truth(2e7 + 5e6, 12.0), seed=3)    # a source 5 ms off
    picked = combine.combine({"udp": udp, "grpc": grpc, "ntp:bad": wrong})
    assert "falseticker:ntp:bad" in picked.flags and "ntp:bad" not in picked.sources
    assert coverage(picked, truth, r) == 1.0


def test_composition_adds_the_bounds_along_a_path():
    gateway = Truth(1e8, 20.0)
    g_bounds, r = exchanges(gateway, up_us=100, down_us=100)
    g_model = fit(g_bounds)
    # Edge -> gateway exchanges: offset(edge - gateway) known to within their own delay.
    edge_minus_gateway = 3e7
    lo = np.full(40, edge_minus_gateway - 50_000.0)
    hi = np.full(40, edge_minus_gateway + 50_000.0)
    t = gateway.local(np.linspace(r[0], r[-1], 40)) + int(edge_minus_gateway)
    composed = combine.compose(Bounds(t, lo, t.copy(), hi), g_model)
    g_lo, g_hi = g_model.bounds_at(t - int(edge_minus_gateway))
    assert np.allclose(composed.width, 100_000 + (g_hi - g_lo))
    true = edge_minus_gateway + gateway.theta(np.linspace(r[0], r[-1], 40))
    assert np.all((composed.lo <= true + 1) & (true - 1 <= composed.hi))


def _rpc_world(seed=0):
    """Two nodes with biased models (asymmetric paths) and RPCs between them."""
    rng = np.random.default_rng(seed)
    a, b = Truth(1e8, 10.0), Truth(-2e8, -30.0)
    ba, _ = exchanges(a, up_us=300, down_us=20, seed=seed)      # biased one way
    bb, _ = exchanges(b, up_us=20, down_us=300, seed=seed + 1)  # and the other
    models = [fit(ba), fit(bb)]
    node_a, t_a, node_b, t_b = [], [], [], []
    for r in np.arange(5e9, 290e9, 1e9):
        cs = r
        ss = cs + 30e3 + rng.exponential(5e3)
        se = ss + rng.uniform(50e3, 300e3)
        ce = se + 30e3 + rng.exponential(5e3)
        node_a += [0, 1]
        t_a += [a.local(cs), b.local(se)]
        node_b += [1, 0]
        t_b += [b.local(ss), a.local(ce)]
    facts = causal.Precedence(np.array(node_a), np.array(t_a, dtype=np.int64), np.array(node_b),
                              np.array(t_b, dtype=np.int64))
    return (a, b), models, facts


def test_causality_refinement_removes_violations_and_keeps_the_truth():
    truths, models, facts = _rpc_world()
    before = causal.violations(models, facts)
    assert len(before) > 0                           # the biased models break server-inside-client
    refined = causal.refine(models, facts)
    assert len(refined.violations) == 0
    for truth, m0, m1 in zip(truths, models, refined.models):
        r = np.linspace(10e9, 280e9, 200)
        t = truth.local(r)
        lo, hi = m1.bounds_at(t)
        true = truth.theta(r)
        assert np.all((lo <= true + 1) & (true - 1 <= hi))          # tightening is sound
        assert np.all(hi - lo <= m0.bounds_at(t)[1] - m0.bounds_at(t)[0] + 1)
    width0 = sum(float(np.ptp(np.stack(m.bounds_at(facts.t_a[:1])))) for m in models)
    width1 = sum(float(np.ptp(np.stack(m.bounds_at(facts.t_a[:1])))) for m in refined.models)
    assert width1 < width0                            # and it does tighten


def test_facts_hours_apart_leave_no_violation_and_few_knots():
    """Two RPCs 24 h apart on clocks bounded to +-1 us, each server 0.5 us before its client:
    a correction knot every second across the day took Bellman-Ford 114 s. Knots now sit
    around the facts only; the correction still fixes both and runs straight between."""
    from crosstrace.clock_sync.model import line

    day = 24 * 3600 * 10**9
    models = [line(0.0, 0.0, 0, 1000.0), line(0.0, 0.0, 0, 1000.0)]
    facts = causal.Precedence(np.array([0, 0]), np.array([10**9, day], np.int64),
                              np.array([1, 1]), np.array([10**9 - 500, day - 500], np.int64))
    assert len(causal.violations(models, facts)) == 2
    assert causal._Knots(facts, 2).n <= 2 * 2 * (2 + 2 * causal.DECAY_KNOTS)
    refined = causal.refine(models, facts)
    assert len(refined.violations) == 0
    middle = np.array([day // 2])
    assert all(abs(m.offset_at(middle)[0]) <= 1000 for m in refined.models)   # within the bounds


def test_facts_that_cannot_bind_are_set_aside_without_changing_the_bounds():
    """Add to the RPC facts many that hold for every line the models allow (an event 10 ms
    before another): they are set aside, and the tightened bounds are those of all facts."""
    _, models, facts = _rpc_world()
    loose = causal.Precedence(facts.node_a, facts.t_a - 10_000_000, facts.node_b, facts.t_b)
    both = causal.Precedence(*(np.concatenate([getattr(facts, f), getattr(loose, f)])
                               for f in ("node_a", "t_a", "node_b", "t_b")))
    binding = causal._may_bind(models, both)
    assert not binding[len(facts):].any() and binding[:len(facts)].sum() > 0
    refined, everything = causal.refine(models, both), causal._tighten(list(models), both)
    assert len(refined.violations) == 0
    t = facts.t_a[::7]
    for m, full in zip(refined.models, everything):   # the correction moves estimates, not bounds
        assert np.allclose(np.stack(m.bounds_at(t)), np.stack(full.bounds_at(t)), rtol=0, atol=1)


def test_contradictory_facts_are_reported_as_violations():
    _, models, facts = _rpc_world()
    # b before a and a before b by far more than any clock error: impossible.
    bad = causal.Precedence(np.array([0, 1]), np.array([facts.t_a[0], facts.t_b[0] + 10**9]),
                            np.array([1, 0]), np.array([facts.t_b[0], facts.t_a[0] - 10**9]))
    refined = causal.refine(models, bad)
    assert len(refined.violations) >= 1
    assert all("causality_cycle" in m.flags for m in refined.models)


def test_a_node_in_no_fact_keeps_its_model():
    """A node after the job's nodes (another job's, say) takes part in no fact."""
    _, models, facts = _rpc_world()
    lone = models[0]
    refined = causal.refine(models + [lone], facts)
    assert len(refined.violations) == 0
    assert refined.models[2] is lone


def test_parse_ntp_server():
    from crosstrace.clock_sync.ntp import parse_server
    assert parse_server("pool.ntp.org") == ("pool.ntp.org", 123)
    assert parse_server("127.0.0.1:11123") == ("127.0.0.1", 11123)
    assert parse_server("[::1]:5000") == ("::1", 5000)
    assert parse_server("::1") == ("::1", 123)


def test_ntp_timestamps_are_read_to_the_ns():
    """ntplib's float seconds lost up to 365 ns of each timestamp; the bytes keep it all."""
    import struct

    from crosstrace.clock_sync.ntp import _NTP_TO_UNIX_S, _unix_ns
    for ns in (123_456_789, 999_999_999, 1, 500_000_000):
        fraction = -(-ns * 2**32 // 10**9)    # the nearest fraction at or after ns
        packet = bytes(32) + struct.pack("!II", _NTP_TO_UNIX_S + 1_760_000_000, fraction)
        assert _unix_ns(packet, 32) == 1_760_000_000 * 10**9 + ns


def test_pmc_fields_become_a_bounded_sample():
    from crosstrace.clock_sync.ptp import PtpError, sample_from_fields
    from crosstrace.tracer.clock import Clock
    fields = {"master_offset": "250", "ingress_time": "1000000000000", "meanPathDelay": "3000.0",
              "gmPresent": "true", "gmIdentity": "aa.fffe.bb"}
    wall = iter([1_000_000_500_000, 1_000_000_500_100])
    s = sample_from_fields(fields, local_at=lambda t: t + 7_000_000, realtime_ns=lambda: next(wall),
                           monotonic_ns=lambda: 5_000_000_000)
    # The Sync came in 500,050 ns before the monotonic reading; the port is 250 ns ahead of the master.
    local = 5_000_000_000 - 500_050 + 7_000_000
    assert s.local_ns == local and s.ref_minus_local_ns == 1_000_000_000_000 - 250 - local
    assert s.error_ns == 3000 + 100 + 1   # path delay, the reading's window
    # A Sync 1 s old, on a clock 100 ppm fast: read at the ingress, not when pmc answered (the
    # truth was 99,991 ns outside the bound).
    clock = Clock(3_000_000, 100.0, epoch_ns=0)
    ingress = 1_000_000_000_000
    wall = iter([ingress + 10**9, ingress + 10**9 + 100])
    s = sample_from_fields({**fields, "master_offset": "0"}, local_at=clock.at, realtime_ns=lambda: next(wall),
                           monotonic_ns=lambda: 50 * 10**9)
    local_at_ingress = clock.at(50 * 10**9 - 10**9 - 50)
    assert abs(s.ref_minus_local_ns - (ingress - local_at_ingress)) <= s.error_ns < 3200
    with pytest.raises(PtpError):
        sample_from_fields({**fields, "gmPresent": "false"}, local_at=lambda t: t)


def test_thinning_many_bounds_stays_sound():
    """Past MAX_BOUNDS, clip_all keeps a subset of the bounds: never tighter than all of them."""
    rng = np.random.default_rng(5)
    n = geometry.MAX_BOUNDS * 3
    u = rng.uniform(-500, 500, n)
    v = 20.0 * u + np.abs(rng.normal(0, 3e4, n)) + 50     # the line a=0, b=20 satisfies all
    start = geometry.box(-1e6, 1e6, 1e4)
    thinned = geometry.clip_all(start, u, v, upper=True)
    exact = start
    for k in range(n):
        exact = geometry.clip(exact, u[k], v[k], upper=True)
    grid = np.linspace(-600, 600, 25)
    lo_t, hi_t = geometry.extent(thinned, grid)
    lo_e, hi_e = geometry.extent(exact, grid)
    assert np.all(lo_t <= lo_e + 1e-6) and np.all(hi_t >= hi_e - 1e-6)
    assert np.all(hi_t - hi_e <= 0.05 * (hi_e - lo_e) + 1e3)    # and not much looser


def test_a_step_in_the_sample_that_opens_a_new_window():
    """Samples every 10 s for 300 s, then one 2 ms off just past the fit window: the new
    window's line was fitted through it, found no line, and every report of the store
    failed (IndexError). It is the last sample: a step, the rest keeps its line."""
    r = np.append(np.arange(0, 301e9, 10e9), 302e9)
    truth = np.full(len(r), 5e6)
    truth[-1] += 2e6
    t1, t4 = np.rint(r + truth).astype(np.int64), np.rint(r + 100e3 + truth).astype(np.int64)
    t2 = np.rint(r + 50e3).astype(np.int64)
    m = fit(exchange.from_exchanges(t1, t2, t2 + 5000, t4), "udp")
    assert m.known and len(m.segments) >= 2
    lo, hi = m.bounds_at(t1[:-1])
    assert np.all(lo <= truth[:-1] + 1) and np.all(truth[:-1] - 1 <= hi)
    lo, hi = m.bounds_at(t1[-1:])
    assert lo[0] <= truth[-1] + 1 and truth[-1] - 1 <= hi[0]


def test_one_wrong_ntp_server_moves_no_node_that_uses_another():
    """Nodes a and e have direct probes and NTP servers that agree; b has probes and a server
    50 ms off; c and d have NTP alone (c through a's server, d through one no probed node
    uses). One joint UTC link through all servers zigzagged between two values and put c
    44 ms off, its bound around the truth 8 % of the time."""
    from crosstrace.collector.align import NodeSources, fit_sources

    epoch = 1_700_000_000 * 10**9          # UTC - collector clock
    truth = {"a": 3e6, "b": -2e6, "c": 7e6, "d": -5e6, "e": 1e6}
    r = np.arange(0, 120e9, 2e9)

    def probes(off):
        t1 = np.rint(r + off).astype(np.int64)
        t2 = np.rint(r + 40e3).astype(np.int64)
        return {"udp": exchange.from_exchanges(t1, t2, t2 + 5000, t1 + 90_000)}

    def ntp(node, server, server_error=0.0, shift_s=0.3):
        local = np.rint(r + shift_s * 1e9 + truth[node]).astype(np.int64)
        return {server: exchange.from_offsets(local, np.full(len(r), epoch - truth[node] + server_error),
                                              np.full(len(r), 1e6))}

    sources = {"a": NodeSources(probes(truth["a"]), ntp("a", "ntp:good"), {}),
               "b": NodeSources(probes(truth["b"]), ntp("b", "ntp:bad", 50e6, 0.7), {}),
               "e": NodeSources(probes(truth["e"]), ntp("e", "ntp:good2", 0.0, 0.5), {}),
               "c": NodeSources({}, ntp("c", "ntp:good", 0.0, 1.1), {}),
               "d": NodeSources({}, ntp("d", "ntp:unprobed", 0.0, 1.3), {})}
    models = fit_sources(sources, epoch)
    for node, model in models.items():
        local = np.rint(r + truth[node]).astype(np.int64)
        lo, hi = model.bounds_at(local)
        assert np.all(lo <= truth[node] + 1) and np.all(truth[node] - 1 <= hi), node
    assert "utc_server_disagrees:ntp:bad" in models["b"].flags
    assert not any(f.startswith("utc") for node in "acde" for f in models[node].flags)
    # One server name that answers b 50 ms off (pool.ntp.org is another server on another
    # node): the link selects among the nodes, and c, which has NTP alone, stays right.
    shifts = {"a": 0.3, "b": 0.7, "c": 1.1, "e": 0.5}
    pool = {node: NodeSources(sources[node].direct, ntp(node, "ntp:pool", 50e6 if node == "b" else 0.0, shift), {})
            for node, shift in shifts.items()}
    for node, model in fit_sources(pool, epoch).items():
        lo, hi = model.bounds_at(np.rint(r + truth[node]).astype(np.int64))
        assert np.all(lo <= truth[node] + 1) and np.all(truth[node] - 1 <= hi), node
    # Two servers and no majority: d cannot be placed by its own server, and says so.
    two = fit_sources({node: sources[node] for node in "abd"}, epoch)
    assert "utc_servers_disagree" in two["d"].flags
    assert not any(f.startswith("utc") for node in "ab" for f in two[node].flags)
