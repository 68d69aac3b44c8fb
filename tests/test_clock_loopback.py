"""Real collectors and tracer processes with injected clocks: the collector recovers every
node's offset and drift within its bounds, over UDP and gRPC, and RPC causality holds."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from crosstrace.clock_sync import udp
from crosstrace.collector import spantable
from crosstrace.collector.align import align, fit_models
from crosstrace.collector.columns import view
from crosstrace.collector.server import Collector
from crosstrace.collector.store import Store
from crosstrace.collector.udp_clock import UdpClockResponder
from crosstrace.launch import wait_until
from crosstrace.proto import pb
from crosstrace.tracer.clock import Clock
from crosstrace.tracer.clock_probe import _UDP_GIVE_UP_AFTER

from .conftest import first_line, run_python, tracer_env

WORKER = """
import sys, time, crosstrace
provider = crosstrace.init()
tracer = provider.get_tracer("test")
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    with tracer.start_as_current_span("tick"):
        time.sleep(0.001)
    time.sleep(0.05)
provider.shutdown()
"""


def injected_offset(local, offset_ns, drift_ppm, epoch_ns):
    """The simulated clock's true offset at its readings `local`."""
    return Clock(offset_ns, drift_ppm, epoch_ns).offset_at_local(np.asarray(local, dtype=np.float64))


def sim_env(collector, node, offset_ns, drift_ppm, epoch_ns, **extra):
    return tracer_env(collector, node, sim_clock_offset_ns=offset_ns, sim_clock_drift_ppm=drift_ppm,
                      sim_clock_epoch_ns=epoch_ns, clock_probe_interval_s=0.3, **extra)


def span_starts(store, node_id):
    nodes = {i: r.node_id for i, r in store.nodes().items()}
    return np.concatenate([view(seg)["start_ns"] for node, seg in store.segments() if nodes[node] == node_id])


def test_udp_and_grpc_recover_injected_clocks_within_bounds(collector):
    epoch = time.monotonic_ns()
    # "server": a machine up a day longer than the collector's (monotonic clocks count from boot)
    truth = {"edge": (734_000_123, 87.5), "cloud": (-912_345_678, -64.25), "server": (86_400_000_000_123, 100.0)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, "3"],
                              env={**os.environ, **sim_env(collector, node, off, drift, epoch)})
             for node, (off, drift) in truth.items()]
    for p in procs:
        assert p.wait(timeout=60) == 0
    collector.stop()
    store = Store(collector.store, readonly=True)
    try:
        models = fit_models(store)
        rows = store.clock_samples()
        starts = {node: span_starts(store, node) for node in truth}
    finally:
        store.close()
    assert {r[1] for r in rows} == {pb.UDP_EXCHANGE, pb.GRPC_EXCHANGE}
    for node, (off, drift) in truth.items():
        m = models[node]
        assert set(m.sources) == {"udp", "grpc"}, m
        t = starts[node]
        true = injected_offset(t, off, drift, epoch)
        lo, hi = m.bounds_at(t)
        assert np.all((lo <= true + 1) & (true - 1 <= hi)), (node, (true - lo).min(), (hi - true).min())
        assert np.all(np.abs(m.offset_at(t) - true) <= m.error_at(t) + 1)
        assert np.abs(m.offset_at(t) - true).max() < 1_000_000, node   # loopback UDP: us; the bound is no excuse
        assert abs(m.drift_ppm - drift) <= m.drift_error_ppm + 0.01
        # The UDP channel alone bounds the clock far more tightly than gRPC alone (same run).
        udp_width = [r[6] - r[3] - (r[5] - r[4]) for r in rows if r[1] == pb.UDP_EXCHANGE]
        grpc_width = [r[6] - r[3] - (r[5] - r[4]) for r in rows if r[1] == pb.GRPC_EXCHANGE]
        assert min(udp_width) < min(grpc_width)


def test_clocks_command_prints_each_node(collector):
    epoch = time.monotonic_ns()
    run_python(WORKER, sim_env(collector, "n1", 5_000_000, 10.0, epoch, udp_clock=0), args=("1",))
    collector.stop()
    out = subprocess.run([sys.executable, "-m", "crosstrace", "clocks", "--store", collector.store, "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(out.stdout)
    c = doc["clocks"]["n1"]
    assert c["sources"] == ["grpc"]            # UDP switched off in this tracer
    assert abs(c["offset_ns"] - 5_000_000) <= c["error_bound_ns"] + 100_000
    assert c["samples"] > 0 and c["segments"] >= 1 and doc["causality"]["violations"] == 0
    text = subprocess.run([sys.executable, "-m", "crosstrace", "clocks", "--store", collector.store],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "n1" in text and "grpc" in text


def test_a_node_id_back_on_another_clock_is_kept_apart(collector):
    """A machine rebooted (or a pod rescheduled) under the same node id: its clock starts
    again, here -20 s where it was +2 s. The two clocks get two models, each recovered; a
    process on the first clock again (a restart without a reboot) stays the first node."""
    epoch = time.monotonic_ns()
    runs = [(2_000_000_000, 30.0), (-20_000_000_000, -50.0), (2_000_000_000, 30.0)]
    for offset, drift in runs:
        run_python(WORKER, sim_env(collector, "rebooted", offset, drift, epoch), args=("1.5",))
    collector.stop()
    doc = json.loads(subprocess.run([sys.executable, "-m", "crosstrace", "clocks", "--store", collector.store,
                                     "--json"], capture_output=True, text=True, timeout=60, check=True).stdout)
    assert sorted(doc["clocks"]) == ["rebooted", "rebooted#2"]
    store = Store(collector.store, readonly=True)
    try:
        models = fit_models(store)
        starts = {node: span_starts(store, node) for node in ("rebooted", "rebooted#2")}
    finally:
        store.close()
    for node, (offset, drift) in zip(("rebooted", "rebooted#2"), runs):
        t = starts[node]
        true = injected_offset(t, offset, drift, epoch)
        assert np.abs(models[node].offset_at(t) - true).max() < 1_000_000, node
        assert np.all(np.abs(models[node].offset_at(t) - true) <= models[node].error_at(t) + 1), node


def test_rpc_spans_are_causally_consistent_after_alignment(collector):
    """Server and client with clocks 0.3 s apart: on the aligned timeline every server span
    lies inside its client span, and the refinement leaves no violation."""
    epoch = time.monotonic_ns()
    mod = "crosstrace.demo.rpc_chain"
    server = subprocess.Popen([sys.executable, "-m", mod, "--role", "model"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **sim_env(collector, "model", 200_000_000, 40.0, epoch)})
    try:
        line = first_line(server)
        assert line.startswith("listening on "), line
        address = line.split()[-1]
        client = subprocess.run([sys.executable, "-m", mod, "--role", "frontend", "--upstream", address,
                                 "--requests", "15"], capture_output=True, text=True, timeout=60,
                                env={**os.environ, **sim_env(collector, "frontend", -100_000_000, -70.0, epoch)})
        assert client.returncode == 0, client.stderr
    finally:
        server.terminate()
        server.wait(20)
    collector.stop()
    store = Store(collector.store, readonly=True)
    try:
        table = spantable.load(store)
        al = align(table, fit_models(store))
    finally:
        store.close()
    assert al.facts >= 30 and al.violations == 0
    clients = np.flatnonzero(table.kind == pb.RPC_CLIENT)
    servers = np.flatnonzero(table.kind == pb.RPC_SERVER)
    by_id = {int(table.span_id[c]): c for c in clients}
    pairs = [(by_id[int(table.parent_id[s])], s) for s in servers if int(table.parent_id[s]) in by_id]
    assert len(pairs) == 15
    for c, s in pairs:
        assert al.start[c] <= al.start[s] and al.end[s] <= al.end[c]
        assert al.error[s] < 1_000_000                  # bounded, not "unknown"


def test_a_collective_queued_on_a_device_is_no_clock_fact(collector):
    """Two ranks with exact clocks (bounds +-50 us); rank 1 enters a synchronous all_reduce
    (or sends what rank 0 receives) 50 ms after rank 0's call, which returns at once. On CPU
    that cannot be: the end is a fact, and the refinement must move a clock. On a GPU (NCCL)
    the call only queued the op: no fact, no clock moved (a right clock was moved 49.9 ms)."""
    from .test_collector_input import batch, export

    def rank_batch(rank, device, seq):
        """Rank 0's span begins at 1.000 s, rank 1's at 1.050 s: a collective (seq 1, 2), or
        rank 0 receiving what rank 1 sends (seq 3, 4)."""
        start = 1_000_000_000 + 50_000_000 * rank
        kind = 2 if seq < 3 else 4 - rank   # collective; recv (4) on rank 0, send (3) on rank 1
        b = batch(1, seq=seq, node=f"r{rank}", trace_hi=7 + seq, first_id=rank + 1, kind=np.array([kind], "u1"),
                  start_ns=np.array([start], "<i8"), end_ns=np.array([start + 100_000], "<i8"))
        b.session_id, b.resource.rank = bytes([rank + 1]) * 16, rank
        if seq < 3:
            attributes = {"collective.group": "g", "collective.seq": seq, "collective.op": "all_reduce",
                          "collective.ranks": [0, 1], **({"collective.device": device} if device else {})}
        else:
            attributes = {"p2p.group": "g", "p2p.src": 1, "p2p.dst": 0, "p2p.tag": 0, "p2p.seq": seq,
                          **({"p2p.device": device} if device else {})}
        b.attributes_json = json.dumps([attributes]).encode()
        for t in range(0, 3_000_000_000, 100_000_000):
            b.clock_samples.append(pb.ClockSample(source=pb.UDP_EXCHANGE, t1=t, t2=t + 50_000, t3=t + 50_000,
                                                  t4=t + 100_000, local_ns=t))
        return b.SerializeToString()

    for seq, device in enumerate(("cuda", None, "cuda", None), 1):
        acks, err = export(collector.address, [rank_batch(rank, device, seq) for rank in (0, 1)])
        assert err is None and len(acks) == 2
        with Store(collector.store, readonly=True) as store:
            table = spantable.load(store, [f"{7 + seq:016x}"])
            al = align(table, fit_models(store))
        moved = np.abs(al.start - table.start).max()
        if device == "cuda":
            assert al.facts == 0 and moved == 0, seq
        else:
            assert al.facts == (2 if seq < 3 else 1) and moved > 40_000_000, seq


def test_udp_responder_answers_probes_and_ignores_garbage():
    responder = UdpClockResponder("127.0.0.1", 0).start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(2)
            sock.sendto(b"not a probe", ("127.0.0.1", responder.port))
            sock.sendto(b"XXXX" + bytes(len(udp.pack_request(0, 0)) - 4), ("127.0.0.1", responder.port))
            t1 = time.monotonic_ns()
            sock.sendto(udp.pack_request(42, t1), ("127.0.0.1", responder.port))
            data, _ = sock.recvfrom(64)
            t4 = time.monotonic_ns()
        nonce, echoed, t2, t3 = udp.unpack_reply(data)
        assert nonce == 42 and echoed == t1
        assert t1 <= t2 <= t3 <= t4                     # one clock on both ends: causal order
        # The responder counts a reply once sent, so the count may trail the reply we got.
        assert wait_until(lambda: responder.answered == 1, 5) and responder.ignored == 2
    finally:
        responder.stop()


def test_a_taken_udp_port_costs_only_the_udp_channel(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        collector = Collector(str(tmp_path / "store.db"), f"127.0.0.1:{port}").start()
        try:
            assert collector.port == port and collector.udp_clock.sock is None
            env = {"CROSSTRACE_ENDPOINT": collector.address, "CROSSTRACE_NODE_ID": "n"}
            run_python("import crosstrace; p = crosstrace.init(); p.get_tracer('t').start_span('s').end(); "
                       "p.shutdown()", env)
        finally:
            collector.stop()
    store = Store(str(tmp_path / "store.db"), readonly=True)
    try:
        sources = {r[1] for r in store.clock_samples()}
    finally:
        store.close()
    assert sources == {pb.GRPC_EXCHANGE}


def test_udp_probing_starts_when_the_collector_comes_up_late(tmp_path):
    """A tracer started before its collector: rounds where nothing answered at all said
    nothing about UDP, yet three of them gave UDP up for good."""
    from crosstrace.launch import CollectorProcess, free_port

    port = free_port()
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # holds the port, hears the probes, answers none
    silent.bind(("127.0.0.1", port))
    silent.settimeout(0.5)
    env = {**os.environ, "CROSSTRACE_ENDPOINT": f"127.0.0.1:{port}", "CROSSTRACE_NODE_ID": "early",
           "CROSSTRACE_CLOCK_PROBE_INTERVAL_S": "0.1"}
    tracer = subprocess.Popen([sys.executable, "-c", WORKER, "5"], env=env)
    try:
        heard = 0   # a round's UDP probe, unanswered, ends its UDP part: one datagram a round
        deadline = time.monotonic() + 30
        while heard < _UDP_GIVE_UP_AFTER + 1 and time.monotonic() < deadline:
            try:
                heard += bool(silent.recv(64))
            except TimeoutError:
                pass
        silent.close()
        assert heard > _UDP_GIVE_UP_AFTER, f"UDP probing stopped after {heard} rounds that nobody answered at all"
        with CollectorProcess(str(tmp_path / "store.db"), listen=f"127.0.0.1:{port}") as collector:
            assert tracer.wait(timeout=60) == 0
            store = Store(collector.store, readonly=True)
            try:
                sources = {r[1] for r in store.clock_samples()}
            finally:
                store.close()
    finally:
        silent.close()
        if tracer.poll() is None:
            tracer.kill()
    assert sources == {pb.UDP_EXCHANGE, pb.GRPC_EXCHANGE}


RUN = """
import time, crosstrace
provider = crosstrace.init()
with provider.get_tracer("test").start_as_current_span("run"):
    print(time.time_ns())
    time.sleep(0.3)   # clock probes come 0.2 s after start
provider.shutdown()
"""


def test_a_collector_on_another_clock_continues_the_stores_timeline(tmp_path):
    """The collector's machine reboots between two runs on one store (its monotonic clock
    starts again; here an hour behind). The second collector goes on with the store's
    timeline through the wall clock: one node's samples from both runs still fit one clock,
    and the runs' spans are as far apart as the wall clock says, not an hour off."""
    path = str(tmp_path / "store.db")
    env = {"CROSSTRACE_NODE_ID": "n", "CROSSTRACE_SIM_CLOCK_OFFSET_NS": "250000000"}
    rebooted = Clock(offset_ns=-3600 * 10**9)
    walls = []
    for now, clock in ((time.monotonic_ns, None), (rebooted.now, rebooted.domain()), (rebooted.now, rebooted.domain())):
        collector = Collector(path, "127.0.0.1:0", now=now, clock=clock).start()
        try:
            walls.append(int(run_python(RUN, {**env, "CROSSTRACE_ENDPOINT": collector.address}).stdout))
        finally:
            collector.stop()
    store = Store(path, readonly=True)
    try:
        clocks = store.collector_clocks()
        table = spantable.load(store)
        models = fit_models(store)
        al = align(table, models, int(store.meta("epoch_offset_ns")))
    finally:
        store.close()
    assert [c["shift_ns"] for c in clocks][0] == 0 and len(clocks) == 2   # the third run: the second's clock
    assert abs(clocks[1]["shift_ns"] - 3600 * 10**9) < 50_000_000
    model = models["n"]
    assert model.known and not model.flags and model.error_ns < 1_000_000, model
    assert abs(model.offset_ns - 250_000_000) < 1_000_000
    starts = np.sort(al.start[table.name == table.names.index("run")])
    assert len(starts) == 3
    for i in (1, 2):   # each span starts just after its process printed the wall time
        assert abs((starts[i] - starts[0]) - (walls[i] - walls[0])) < 5_000_000
