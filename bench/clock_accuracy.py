"""Clock alignment accuracy: crosstrace against the usual methods, against ground truth.

Part 1, simulation. N nodes with offsets up to +-1 s and drifts up to +-100 ppm; a quarter
of them change drift once during the run (a daemon slewing the clock, a temperature
change). Each node probes the collector with a burst of 8 two-way exchanges every 10 s
over a path whose two directions have different base delays (asymmetric) plus
exponential jitter and rare queueing spikes. The trace: RPCs between random node pairs
(over asymmetric paths of their own) and all-reduces over all nodes. Methods:
  single     one exchange per burst, offset = midpoint (ntplib), held until the next
  min-delay  the quickest exchange of each burst (NTP's clock filter), held
  jaeger     min-delay per host, then every RPC server span centred in its client span
  score-p    min-delay bursts at the start and at the end, linear interpolation
  crosstrace hull fit of all exchanges, piecewise, then refinement by the trace's causality
Errors are |estimated - true offset| at every span start/end; drift error at the end of
the run; coverage: how often the reported bound contains the truth; violations: causality
facts (RPC server inside client, nobody leaves an all-reduce before the last entered)
that the aligned times still break.

Part 2, loopback. A real collector and tracer processes with injected clocks
(CROSSTRACE_SIM_CLOCK_*), probing over UDP and gRPC; each channel's samples are fitted
alone and compared with the injected truth at every span.

    python bench/clock_accuracy.py [--quick] [--nodes N] [--seconds S] [--loopback-seconds S]
Targets (issue 4): simulation coverage >= 99 %, crosstrace p99 <= 1/3 of the best
baseline's, 0 violations; loopback UDP median <= 5 us, p99 <= 20 us, drift <= 1 ppm at 60 s.
"""
import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

from crosstrace.clock_sync import causal, exchange
from crosstrace.clock_sync.fit import fit
from crosstrace.tracer.clock import Clock

# -- simulation ----------------------------------------------------------------------------------


@dataclasses.dataclass
class SimClock:
    """theta(r) = local - reference at reference time r (ns)."""
    offset_ns: float
    drift_ppm: float
    change_at_ns: float = np.inf
    drift_after_ppm: float = 0.0

    def theta(self, r):
        r = np.asarray(r, dtype=np.float64)
        bend = (self.drift_after_ppm - self.drift_ppm) * 1e-6 * np.maximum(0.0, r - self.change_at_ns)
        return self.offset_ns + self.drift_ppm * 1e-6 * r + bend

    def local(self, r) -> np.ndarray:
        return np.rint(np.asarray(r, dtype=np.float64) + self.theta(r)).astype(np.int64)

    def drift_at(self, r) -> float:
        return self.drift_after_ppm if r >= self.change_at_ns else self.drift_ppm


class Path:
    """One direction of a network path: base delay + exponential jitter + rare spikes."""

    def __init__(self, rng, base_us: float):
        self.rng, self.base = rng, base_us * 1000

    def delay(self, n: int) -> np.ndarray:
        jitter = self.rng.exponential(0.3 * self.base, n)
        spikes = self.rng.exponential(1_000_000, n) * (self.rng.random(n) < 0.05)
        return self.base + jitter + spikes


@dataclasses.dataclass
class World:
    clocks: list[SimClock]
    exchanges: list[dict]      # per node: t1, t2, t3, t4 arrays (t2/t3 on the reference)
    events_node: np.ndarray    # every span start/end: node, local time, reference time
    events_local: np.ndarray
    events_ref: np.ndarray
    facts: causal.Precedence
    rpcs: list[tuple]          # (client, server, c_start, c_end, s_start, s_end) local times
    duration_ns: int


def simulate(n_nodes: int, seconds: float, seed: int, drift_changes: bool = True) -> World:
    rng = np.random.default_rng(seed)
    T = int(seconds * 1e9)
    clocks = []
    for k in range(n_nodes):
        c = SimClock(rng.uniform(-1e9, 1e9), rng.uniform(-100, 100))
        if drift_changes and k % 4 == 3:
            c.change_at_ns = rng.uniform(0.3, 0.7) * T
            c.drift_after_ppm = c.drift_ppm + rng.choice([-1, 1]) * rng.uniform(5, 20)
        clocks.append(c)
    exchanges = []
    for c in clocks:
        up, down = Path(rng, rng.uniform(20, 200)), None
        down = Path(rng, up.base / 1000 * rng.uniform(0.5, 2.0))
        starts = np.arange(0, T, 10_000_000_000)
        r1 = (starts[:, None] + np.arange(8)[None, :] * 1_000_000).ravel() + rng.uniform(0, 1e6)
        r2 = r1 + up.delay(len(r1))
        r3 = r2 + 10_000
        r4 = r3 + down.delay(len(r1))
        exchanges.append({"t1": c.local(r1), "t2": np.rint(r2).astype(np.int64),
                          "t3": np.rint(r3).astype(np.int64), "t4": c.local(r4)})
    ev_node, ev_ref = [], []
    fa_node, fa_ref, fb_node, fb_ref = [], [], [], []
    rpcs = []
    pair_paths = {}
    for r in np.arange(0.25e9, T, 0.5e9):          # RPCs between random pairs
        a, b = rng.choice(n_nodes, 2, replace=False)
        if (a, b) not in pair_paths:
            pair_paths[(a, b)] = (Path(rng, rng.uniform(50, 500)), Path(rng, rng.uniform(50, 500)))
        fwd, back = pair_paths[(a, b)]
        cs = r
        ss = cs + fwd.delay(1)[0]
        se = ss + rng.uniform(0.2e6, 5e6)
        ce = se + back.delay(1)[0]
        ev_node += [a, a, b, b]
        ev_ref += [cs, ce, ss, se]
        fa_node += [a, b]
        fa_ref += [cs, se]
        fb_node += [b, a]
        fb_ref += [ss, ce]
        rpcs.append((a, b, cs, ce, ss, se))
    for r in np.arange(0.5e9, T, 1e9):              # all-reduces over every node
        entry = r + rng.uniform(0, 5e6, n_nodes)
        leave = entry.max() + rng.uniform(50e3, 500e3) + rng.uniform(0, 50e3, n_nodes)
        for k in range(n_nodes):
            ev_node += [k, k]
            ev_ref += [entry[k], leave[k]]
        j, k = np.meshgrid(np.arange(n_nodes), np.arange(n_nodes), indexing="ij")
        off = j != k
        fa_node += j[off].tolist()
        fa_ref += entry[j[off]].tolist()
        fb_node += k[off].tolist()
        fb_ref += leave[k[off]].tolist()
    ev_node, ev_ref = np.array(ev_node), np.array(ev_ref)
    ev_local = np.empty(len(ev_ref), dtype=np.int64)
    for k, c in enumerate(clocks):
        ev_local[ev_node == k] = c.local(ev_ref[ev_node == k])

    def local_of(nodes, refs):
        nodes, refs = np.array(nodes), np.array(refs)
        out = np.empty(len(refs), dtype=np.int64)
        for k, c in enumerate(clocks):
            out[nodes == k] = c.local(refs[nodes == k])
        return nodes, out

    na, ta = local_of(fa_node, fa_ref)
    nb, tb = local_of(fb_node, fb_ref)
    local_rpcs = [(a, b, clocks[a].local(cs), clocks[a].local(ce), clocks[b].local(ss), clocks[b].local(se))
                  for a, b, cs, ce, ss, se in rpcs]
    return World(clocks, exchanges, ev_node, ev_local, ev_ref, causal.Precedence(na, ta, nb, tb), local_rpcs, T)


@dataclasses.dataclass
class Estimate:
    """A method's offset (and bound, where it has one) at every event; its end drift."""
    offset: np.ndarray
    lo: np.ndarray | None
    hi: np.ndarray | None
    drift_ppm: np.ndarray | None   # per node at the end; None: the method has no drift


def _held(t_sample, mid, half, t):
    """Sample-and-hold: the latest sample before t (the first one before any)."""
    i = np.clip(np.searchsorted(t_sample, t, side="right") - 1, 0, len(t_sample) - 1)
    return mid[i], mid[i] - half[i], mid[i] + half[i]


def _per_node(world: World, fn) -> Estimate:
    n = len(world.events_local)
    off, lo, hi = np.zeros(n), np.zeros(n), np.zeros(n)
    drift = []
    for k, x in enumerate(world.exchanges):
        rows = world.events_node == k
        o, l_, h, d = fn(k, x, world.events_local[rows])
        off[rows], lo[rows], hi[rows] = o, l_, h
        drift.append(d)
    with_drift = all(d is not None for d in drift)
    return Estimate(off, lo, hi, np.array(drift) if with_drift else None)


def method_single(world: World) -> Estimate:
    def fn(k, x, t):
        b = exchange.from_exchanges(x["t1"], x["t2"], x["t3"], x["t4"])
        first = np.r_[True, np.diff(exchange.bursts(b.t, 1_000_000_000)) > 0]
        b = b.take(first)
        return (*_held(b.t, b.mid, b.width / 2, t), None)
    return _per_node(world, fn)


def _min_delay(x) -> exchange.Bounds:
    """The lowest-delay exchange of each burst (NTP's clock filter): queueing only ever
    adds delay, so the quickest round trip is the least distorted."""
    bounds = exchange.from_exchanges(x["t1"], x["t2"], x["t3"], x["t4"]).sorted()
    burst = exchange.bursts(bounds.t, 1_000_000_000)
    order = np.lexsort((bounds.width, burst))
    first = order[np.r_[True, burst[order][1:] != burst[order][:-1]]] if len(order) else order
    return bounds.take(np.sort(first))


def method_min_delay(world: World) -> Estimate:
    def fn(k, x, t):
        b = _min_delay(x)
        return (*_held(b.t, b.mid, b.width / 2, t), None)
    return _per_node(world, fn)


def method_score_p(world: World) -> Estimate:
    def fn(k, x, t):
        b = _min_delay(x)
        t0, t1, o0, o1 = b.t[0], b.t[-1], b.mid[0], b.mid[-1]
        slope = (o1 - o0) / (t1 - t0)
        est = o0 + slope * (t - t0)
        return est, est, est, slope * 1e6
    out = _per_node(world, fn)
    return dataclasses.replace(out, lo=None, hi=None)


def method_jaeger(world: World) -> Estimate:
    base = method_min_delay(world)
    off = base.offset.copy()
    index = {(int(n), int(t)): i for i, (n, t) in enumerate(zip(world.events_node, world.events_local))}
    for a, b, cs, ce, ss, se in world.rpcs:
        ia = index[(a, int(cs))]
        client_mid = (cs + ce) / 2
        ref_mid = client_mid - off[ia]                   # client's host clock, NTP-like
        theta_server = (ss + se) / 2 - ref_mid           # centre the server span in it
        off[index[(b, int(ss))]] = theta_server
        off[index[(b, int(se))]] = theta_server
    return Estimate(off, None, None, None)


def crosstrace_models(world: World):
    return [fit(exchange.from_exchanges(x["t1"], x["t2"], x["t3"], x["t4"])) for x in world.exchanges]


def _estimate_from_models(world: World, models) -> Estimate:
    n = len(world.events_local)
    off, lo, hi = np.zeros(n), np.zeros(n), np.zeros(n)
    for k, m in enumerate(models):
        rows = world.events_node == k
        off[rows] = m.offset_at(world.events_local[rows])
        lo[rows], hi[rows] = m.bounds_at(world.events_local[rows])
    return Estimate(off, lo, hi, np.array([m.drift_ppm for m in models]))


def method_crosstrace_exchanges(world: World) -> Estimate:
    return _estimate_from_models(world, crosstrace_models(world))


def method_crosstrace(world: World) -> Estimate:
    return _estimate_from_models(world, causal.refine(crosstrace_models(world), world.facts).models)


METHODS = [("single (ntplib)", method_single), ("min-delay (NTP filter)", method_min_delay),
           ("jaeger centring", method_jaeger), ("score-p interpolation", method_score_p),
           ("crosstrace, exchanges only", method_crosstrace_exchanges), ("crosstrace", method_crosstrace)]


def score(world: World, est: Estimate) -> dict:
    truth = np.empty(len(world.events_ref))
    for k, c in enumerate(world.clocks):
        rows = world.events_node == k
        truth[rows] = c.theta(world.events_ref[rows])
    err = np.abs(est.offset - truth)
    out = {"p50": np.percentile(err, 50), "p99": np.percentile(err, 99)}
    if est.drift_ppm is not None:
        true_drift = np.array([c.drift_at(world.duration_ns) for c in world.clocks])
        out["drift"] = float(np.abs(est.drift_ppm - true_drift).max())
    if est.lo is not None:
        out["coverage"] = float(np.mean((est.lo <= truth + 0.5) & (truth - 0.5 <= est.hi)))
    lookup = {}
    for i, (n, t) in enumerate(zip(world.events_node.tolist(), world.events_local.tolist())):
        lookup[(n, t)] = est.offset[i]
    f = world.facts
    ref_a = f.t_a - np.array([lookup[(n, t)] for n, t in zip(f.node_a.tolist(), f.t_a.tolist())])
    ref_b = f.t_b - np.array([lookup[(n, t)] for n, t in zip(f.node_b.tolist(), f.t_b.tolist())])
    out["violations"] = int(np.sum(np.rint(ref_b) < np.rint(ref_a)))
    out["facts"] = len(f)
    return out


def run_simulation(nodes: int, seconds: float, seeds: list[int], drift_changes: bool = True) -> dict:
    results: dict[str, list[dict]] = {name: [] for name, _ in METHODS}
    timing = {name: 0.0 for name, _ in METHODS}
    for seed in seeds:
        world = simulate(nodes, seconds, seed, drift_changes)
        for name, method in METHODS:
            t0 = time.perf_counter()
            est = method(world)
            timing[name] += time.perf_counter() - t0
            results[name].append(score(world, est))
    print(f"\nsimulation: {nodes} nodes x {seconds:.0f} s x {len(seeds)} seeds; bursts of 8 exchanges every 10 s; "
          f"RPCs every 0.5 s, all-reduce every 1 s; "
          + ("a quarter of the nodes change drift once" if drift_changes else "constant drifts (--steady)"))
    header = f"{'method':28s} {'p50 err':>10s} {'p99 err':>10s} {'drift err':>10s} {'coverage':>9s} " \
             f"{'violations':>16s} {'time':>7s}"
    print(header)
    print("-" * len(header))
    summary = {}
    for name, _ in METHODS:
        rs = results[name]
        p50 = np.median([r["p50"] for r in rs])
        p99 = np.max([r["p99"] for r in rs])
        drift = max(r["drift"] for r in rs) if "drift" in rs[0] else None
        cov = min(r["coverage"] for r in rs) if "coverage" in rs[0] else None
        viol, facts = sum(r["violations"] for r in rs), sum(r["facts"] for r in rs)
        summary[name] = {"p50": p50, "p99": p99, "drift": drift, "coverage": cov, "violations": viol}
        print(f"{name:28s} {_us(p50):>10s} {_us(p99):>10s} "
              f"{'-' if drift is None else f'{drift:.3f} ppm':>10s} "
              f"{'-' if cov is None else f'{cov * 100:.2f} %':>9s} {f'{viol}/{facts}':>16s} "
              f"{timing[name] / len(seeds):6.2f}s")
    print("(p50: median over seeds; p99, drift error: worst seed; coverage: worst seed; violations: all seeds)")
    return summary


def _us(ns: float) -> str:
    if ns < 1000:
        return f"{ns:.0f} ns"
    return f"{ns / 1000:.1f} us" if ns < 1e6 else f"{ns / 1e6:.2f} ms"


# -- loopback ------------------------------------------------------------------------------------

_WORKER = textwrap.dedent("""
    import sys, time, crosstrace
    provider = crosstrace.init()
    tracer = provider.get_tracer("bench")
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        with tracer.start_as_current_span("tick"):
            time.sleep(0.002)
        time.sleep(0.1)
    provider.shutdown()
""")


def run_loopback(n_procs: int, seconds: float, seed: int) -> dict:
    from crosstrace.collector.columns import view
    from crosstrace.collector.store import Store
    from crosstrace.launch import CollectorProcess
    from crosstrace.proto import pb

    rng = np.random.default_rng(seed)
    truth = {f"node{k}": (int(rng.uniform(-1e9, 1e9)), round(float(rng.uniform(-100, 100)), 3))
             for k in range(n_procs)}
    epoch = time.monotonic_ns()
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(os.path.join(tmp, "store.db"))
        try:
            procs = []
            for node, (offset, drift) in truth.items():
                env = {**os.environ, "CROSSTRACE_ENDPOINT": collector.address, "CROSSTRACE_NODE_ID": node,
                       "CROSSTRACE_SIM_CLOCK_OFFSET_NS": str(offset), "CROSSTRACE_SIM_CLOCK_DRIFT_PPM": str(drift),
                       "CROSSTRACE_SIM_CLOCK_EPOCH_NS": str(epoch), "CROSSTRACE_CLOCK_PROBE_INTERVAL_S": "1"}
                procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(seconds)], env=env))
            for p in procs:
                p.wait(timeout=seconds + 60)
        finally:
            collector.stop()
        store = Store(os.path.join(tmp, "store.db"), readonly=True)
        nodes = {i: r.node_id for i, r in store.nodes().items()}
        samples = store.clock_samples()
        span_times = {}
        for node, seg in store.segments():
            span_times.setdefault(nodes[node], []).append(view(seg)["start_ns"])
        store.close()
    print(f"\nloopback: {n_procs} tracer processes, {seconds:.0f} s, bursts of 8 every 1 s; injected offsets up to "
          f"+-1 s and drifts up to +-100 ppm; error at every span against the injected truth")
    header = f"{'channel':8s} {'p50 err':>10s} {'p99 err':>10s} {'max err':>10s} {'drift err':>10s} " \
             f"{'min rtt':>10s} {'coverage':>9s}"
    print(header)
    print("-" * len(header))
    summary = {}
    for name, source in (("udp", pb.UDP_EXCHANGE), ("grpc", pb.GRPC_EXCHANGE)):
        errs, drifts, rtts, covered = [], [], [], []
        for node, (offset, drift) in truth.items():
            rows = [r for r in samples if nodes[r[0]] == node and r[1] == source]
            if not rows:
                continue
            cols = list(zip(*rows))
            b = exchange.from_exchanges(cols[3], cols[4], cols[5], cols[6])
            model = fit(b)
            t = np.concatenate(span_times.get(node, [b.t]))
            true = _injected_offset(t, offset, drift, epoch)
            est = model.offset_at(t)
            lo, hi = model.bounds_at(t)
            errs.append(np.abs(est - true))
            covered.append((lo <= true + 1) & (true - 1 <= hi))
            drifts.append(abs(model.drift_ppm - drift))
            rtts.append(b.width.min())
        if not errs:
            print(f"{name:8s} no samples")
            continue
        e = np.concatenate(errs)
        summary[name] = {"p50": np.percentile(e, 50), "p99": np.percentile(e, 99), "drift": max(drifts)}
        print(f"{name:8s} {_us(summary[name]['p50']):>10s} {_us(summary[name]['p99']):>10s} {_us(e.max()):>10s} "
              f"{max(drifts):7.3f} ppm {_us(min(rtts)):>10s} {np.concatenate(covered).mean() * 100:8.2f} %")
    return summary


def _injected_offset(local, offset, drift_ppm, epoch):
    """The simulated clock's true offset at its readings `local`."""
    return Clock(offset, drift_ppm, epoch).offset_at_local(np.asarray(local, dtype=np.float64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 30 s in all)")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=None, help="simulated run length (default 600)")
    parser.add_argument("--seeds", type=int, default=None, help="simulated worlds (default 5)")
    parser.add_argument("--loopback-seconds", type=float, default=None, help="real run length (default 60)")
    parser.add_argument("--loopback-procs", type=int, default=3)
    parser.add_argument("--steady", action="store_true", help="no drift changes (the case linear interpolation "
                        "is made for)")
    parser.add_argument("--no-loopback", action="store_true")
    args = parser.parse_args()
    seconds = args.seconds or (200 if args.quick else 600)
    seeds = list(range(args.seeds or (2 if args.quick else 5)))
    sim = run_simulation(args.nodes, seconds, seeds, drift_changes=not args.steady)
    baselines = [v["p99"] for k, v in sim.items() if not k.startswith("crosstrace")]
    ours = sim["crosstrace"]
    print(f"\ncrosstrace p99 / best baseline p99 = {ours['p99'] / min(baselines):.3f} (target <= 0.333); "
          f"coverage {ours['coverage'] * 100:.2f} % (target >= 99 %); violations {ours['violations']} (target 0)")
    if args.no_loopback:
        return
    loop_s = args.loopback_seconds or (15 if args.quick else 60)
    loop = run_loopback(args.loopback_procs, loop_s, seed=1)
    if "udp" in loop:
        u = loop["udp"]
        print(f"\nloopback UDP: median {_us(u['p50'])} (target <= 5 us), p99 {_us(u['p99'])} (target <= 20 us), "
              f"drift error {u['drift']:.3f} ppm after {loop_s:.0f} s (target <= 1 ppm after 60 s)")
    if "udp" in loop and "grpc" in loop:
        print(f"gRPC / UDP p50 error ratio: {loop['grpc']['p50'] / max(loop['udp']['p50'], 1):.1f}")


if __name__ == "__main__":
    main()
