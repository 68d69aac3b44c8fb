"""Demo workload: an edge device calls a cloud model through a delaying link.

The edge (preprocess, then a gRPC call) runs with a clock several hundred ms off; the
link is crosstrace.netproxy.DelayProxy (30 ms up, 10 ms down, +-2 ms jitter); the cloud
queues each request for its single torch model worker. What was injected is returned,
so the demo can set it next to what the report measured (uplink, downlink, clock offset).
"""
from ..netproxy import DelayProxy
from .workers import SimClock, Workers

UP_MS, DOWN_MS, JITTER_MS = 30.0, 10.0, 2.0
EDGE_CLOCK = SimClock(450_000_000, 30.0)
CLOUD_CLOCK = SimClock(-35_000_000, -8.0)
REQUESTS = 30
MODULE = "crosstrace.demo.edge_worker"


def run(workers: Workers, say) -> dict:
    """Cloud, link, then the edge's requests; the cloud is stopped (and flushed) at the end.
    Returns the injected link delays and edge clock."""
    cloud = workers.start(["-m", MODULE, "--role", "cloud"], workers.env("cloud", CLOUD_CLOCK), wait_listening=True)
    cloud_proc = workers.procs[-1]
    with DelayProxy(cloud, up_ms=UP_MS, down_ms=DOWN_MS, jitter_ms=JITTER_MS, seed=6) as link:
        say(f"edge: {REQUESTS} requests, link {UP_MS:.0f} ms up / {DOWN_MS:.0f} ms down +-{JITTER_MS:.0f} ms, "
            f"edge clock {EDGE_CLOCK.offset_ns / 1e6:+.0f} ms {EDGE_CLOCK.drift_ppm:+.0f} ppm")
        workers.start(["-m", MODULE, "--role", "edge", "--upstream", link.address, "--requests", str(REQUESTS)],
                      workers.env("edge", EDGE_CLOCK))
        edge = workers.procs[-1]
        try:
            workers.finish(edge, 60, "edge")
        finally:   # stopped while the link is up: an interrupted demo's edge has no calls cut to fail
            if edge.poll() is None:
                edge.terminate()
                workers.wait(edge, 10)
    cloud_proc.terminate()              # flushes its spans on SIGTERM
    workers.wait(cloud_proc, 30)
    return {"requests": REQUESTS, "up_ms": UP_MS, "down_ms": DOWN_MS, "jitter_ms": JITTER_MS,
            "edge_offset_ns": EDGE_CLOCK.offset_ns, "edge_drift_ppm": EDGE_CLOCK.drift_ppm}
