"""Relay mode with real processes: devices -> `crosstrace collector --forward-to` (an edge
gateway) -> the cloud collector. Every span arrives upstream once, the devices' clock
samples go up naming the gateway, and upstream composes device -> gateway -> cloud with
bounds that add up; simulated clocks on the devices and on the gateway give the truth."""
import subprocess
import sys
import time

import numpy as np

from crosstrace.collector.align import fit_models
from crosstrace.collector.store import Store
from crosstrace.launch import CollectorProcess, wait_until, free_port
from crosstrace.proto import pb

from .conftest import load_table, run_python
from .test_clock_loopback import injected_offset, span_starts
from .test_spool import stored_indices

DEVICE = """
import sys, time, crosstrace
p = crosstrace.init()
t = p.get_tracer("device")
for i in range(int(sys.argv[1])):
    with t.start_as_current_span("sense", attributes={"i": i}):
        time.sleep(0.001)
    if i % 100 == 99:
        time.sleep(0.1)
print("flushed", p.force_flush(30000))
"""

GATEWAY = (-150_000_000, -20.0)
DEVICES = {"camera": (450_000_000, 30.0), "lidar": (-80_000_000, -15.0)}


def sim(offset_ns: int, drift_ppm: float, epoch_ns: int) -> dict:
    return {"CROSSTRACE_SIM_CLOCK_OFFSET_NS": str(offset_ns), "CROSSTRACE_SIM_CLOCK_DRIFT_PPM": str(drift_ppm),
            "CROSSTRACE_SIM_CLOCK_EPOCH_NS": str(epoch_ns), "CROSSTRACE_CLOCK_PROBE_INTERVAL_S": "0.3"}


def gateway(tmp_path, upstream: str, epoch_ns: int) -> CollectorProcess:
    return CollectorProcess(str(tmp_path / "gateway.db"), env=sim(*GATEWAY, epoch_ns),
                            extra_args=("--forward-to", upstream, "--node-id", "gateway"))


def device(relay: CollectorProcess, node: str, epoch_ns: int, spans: int) -> None:
    env = {"CROSSTRACE_ENDPOINT": relay.address, "CROSSTRACE_NODE_ID": node, **sim(*DEVICES[node], epoch_ns)}
    out = run_python(DEVICE, env, timeout=90, args=(str(spans),))
    assert out.stdout.split() == ["flushed", "True"], out.stderr


def test_devices_through_a_gateway_arrive_once_with_composed_clocks(tmp_path):
    epoch = time.monotonic_ns()
    with CollectorProcess(str(tmp_path / "cloud.db")) as cloud:
        relay = gateway(tmp_path, cloud.address, epoch)
        try:
            for node in DEVICES:
                device(relay, node, epoch, 600)
            assert wait_until(lambda: len(stored_indices(cloud.store)) == 1200, 30)
        finally:
            assert relay.stop() == 0             # a last probe burst and flush upstream
        assert stored_indices(relay.store, "camera") == list(range(600))    # the gateway keeps its own copy
    for node in DEVICES:
        assert stored_indices(cloud.store, node) == list(range(600))       # once each, upstream

    store = Store(cloud.store, readonly=True)
    try:
        models = fit_models(store)
        names = {i: r.node_id for i, r in store.nodes().items()}
        peers = {(names[row[0]], row[1], row[2]) for row in store.clock_samples()}
        starts = {node: span_starts(store, node) for node in DEVICES}
    finally:
        store.close()
    # The devices' exchanges were answered by the gateway: they go up naming it.
    assert {(n, s, p) for n, s, p in peers if n in DEVICES} == {
        (n, source, "gateway") for n in DEVICES for source in (pb.GRPC_EXCHANGE, pb.UDP_EXCHANGE)}
    assert models["gateway"].sources and all(s in ("udp", "grpc") for s in models["gateway"].sources)
    # The gateway's own uncertainty, at its best over its samples: inside every device's bound.
    relay_error = models["gateway"].error_at(np.linspace(*models["gateway"].span_ns, 64).astype(np.int64)).min()
    assert relay_error > 0
    for node, (offset, drift) in DEVICES.items():
        m = models[node]
        assert m.sources == ("rpc:gateway",), m
        t = starts[node]
        true = injected_offset(t, offset, drift, epoch)    # device - cloud: the gateway's clock drops out
        lo, hi = m.bounds_at(t)
        assert np.all((lo <= true + 1) & (true - 1 <= hi)), (node, (true - lo).min(), (hi - true).min())
        assert np.all(m.error_at(t) >= relay_error)        # the gateway's uncertainty is inside
        assert np.all(np.abs(m.offset_at(t) - true) <= m.error_at(t) + 1)


def test_gateway_spools_while_the_cloud_is_down_and_forwards_once_it_is_back(tmp_path):
    epoch = time.monotonic_ns()
    port = free_port()
    relay = gateway(tmp_path, f"127.0.0.1:{port}", epoch)
    try:
        device(relay, "camera", epoch, 300)        # acked by the gateway: on its disk
        with CollectorProcess(str(tmp_path / "cloud.db"), listen=f"127.0.0.1:{port}") as cloud:
            assert wait_until(lambda: len(stored_indices(cloud.store, "camera")) == 300, 30)
            device(relay, "camera", epoch, 200)    # a second run of the device, cloud up
            assert wait_until(lambda: len(stored_indices(cloud.store, "camera")) == 500, 30)
            assert stored_indices(cloud.store, "camera") == sorted(list(range(300)) + list(range(200)))
    finally:
        assert relay.stop() == 0


def test_a_gateway_back_on_another_clock_still_carries_its_devices_clocks(tmp_path):
    """The gateway reboots (here: comes back on another simulated clock) under its node id.
    Upstream keeps it as two rows, "gateway" and "gateway#2"; its devices' exchanges say
    which of its clocks answered them, so the device's clock still composes through the
    right one. Named by node id alone, every exchange through the gateway was ambiguous,
    and the device was left with no clock at all."""
    epoch = time.monotonic_ns()
    camera = DEVICES["camera"]
    with CollectorProcess(str(tmp_path / "cloud.db")) as cloud:
        for offset_ns, drift_ppm in (GATEWAY, (2_000_000_000, 10.0)):
            relay = CollectorProcess(str(tmp_path / "gateway.db"), env=sim(offset_ns, drift_ppm, epoch),
                                     extra_args=("--forward-to", cloud.address, "--node-id", "gateway"))
            try:
                device(relay, "camera", epoch, 300)
            finally:
                assert relay.stop() == 0
        assert wait_until(lambda: len(stored_indices(cloud.store, "camera")) == 600, 30)
    store = Store(cloud.store, readonly=True)
    try:
        models = fit_models(store)
        starts = span_starts(store, "camera")
    finally:
        store.close()
    assert {"gateway", "gateway#2"} <= set(models)
    m = models["camera"]
    assert set(m.sources) == {"rpc:gateway", "rpc:gateway#2"}, m
    true = injected_offset(starts, *camera, epoch)
    assert np.all(np.abs(m.offset_at(starts) - true) <= m.error_at(starts) + 1)


def test_relays_forwarding_to_each_other_stop_the_loop(tmp_path):
    """Two gateways that forward to each other (a configuration slip): a device's batches
    are kept once by each and go round no further. They circled for ever, and a batch of
    clock samples only (not recorded as a batch, so never known as a resend) was stored
    again at every pass."""
    epoch = time.monotonic_ns()
    port_a, port_b = free_port(), free_port()
    a = CollectorProcess(str(tmp_path / "a.db"), listen=f"127.0.0.1:{port_a}",
                         extra_args=("--forward-to", f"127.0.0.1:{port_b}", "--node-id", "a"))
    try:
        with CollectorProcess(str(tmp_path / "b.db"), listen=f"127.0.0.1:{port_b}",
                              extra_args=("--forward-to", f"127.0.0.1:{port_a}", "--node-id", "b")) as b:
            device(a, "camera", epoch, 300)
            assert wait_until(lambda: len(stored_indices(b.store, "camera")) == 300, 30)
            assert wait_until(lambda: any("forwarding loop" in line for line in a.stderr_lines + b.stderr_lines), 10)
            time.sleep(1.0)   # room to go round a few more times, if it did
    finally:
        assert a.stop() == 0
    for path in (a.store, b.store):
        assert stored_indices(path, "camera") == list(range(300))
        store = Store(path, readonly=True)
        try:
            nodes = {i: r.node_id for i, r in store.nodes().items()}
            camera = [(r[1], r[3]) for r in store.clock_samples() if nodes[r[0]] == "camera"]
        finally:
            store.close()
        assert camera and len(camera) == len(set(camera)), path   # each of the device's samples once


def test_a_batch_larger_than_the_gateways_spool_still_goes_up(tmp_path):
    """A spool of 1 MB and a device's batch of 3 MB: the gateway keeps it (its own store)
    and forwards it from memory. It answered UNAVAILABLE, and the device resent it for ever."""
    with CollectorProcess(str(tmp_path / "cloud.db")) as cloud:
        relay = CollectorProcess(str(tmp_path / "gateway.db"),
                                 extra_args=("--forward-to", cloud.address, "--spool-max-mb", "1"))
        try:
            out = run_python("""
                import crosstrace
                p = crosstrace.init()
                p.get_tracer("t").start_span("frame", attributes={"i": 0, "jpeg": "x" * (3 << 20)}).end()
                print("flushed", p.force_flush(20000))
            """, {"CROSSTRACE_ENDPOINT": relay.address, "CROSSTRACE_NODE_ID": "camera"}, timeout=60)
            assert out.stdout.split() == ["flushed", "True"], out.stderr
            assert wait_until(lambda: stored_indices(cloud.store, "camera") == [0], 30)
        finally:
            assert relay.stop() == 0
    assert any("larger than the whole spool" in line for line in relay.stderr_lines)


def test_a_gateway_whose_spool_fails_says_so_and_forwards_once_it_works(tmp_path):
    """A relay's spool folder gone (a cleaner of /tmp, a disk that fails): each batch is
    stored at the gateway but cannot be kept for upstream, so the device is told to retry,
    and both sides say what failed (it read "store write failed", which the store had not,
    and the gateway said nothing); once the folder is back, every span goes up once."""
    import os
    spool = tmp_path / "spool"
    with CollectorProcess(str(tmp_path / "cloud.db")) as cloud:
        relay = CollectorProcess(str(tmp_path / "gateway.db"), extra_args=(
            "--forward-to", cloud.address, "--node-id", "gateway", "--spool", str(spool)))
        try:
            os.rename(spool, tmp_path / "away")      # the spool's lock stays held through its open file
            env = {"CROSSTRACE_ENDPOINT": relay.address, "CROSSTRACE_NODE_ID": "camera"}
            script = DEVICE.replace("force_flush(30000)", "force_flush(60000)")
            device = subprocess.Popen([sys.executable, "-c", script, "20"], env={**os.environ, **env},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                assert wait_until(lambda: any("could not keep a batch for upstream" in line
                                              for line in relay.stderr_lines), 30), relay.stderr_lines
                time.sleep(3)                                # the device retries meanwhile
                os.rename(tmp_path / "away", spool)
                out, err = device.communicate(timeout=90)
            finally:
                device.kill()
            assert out.split() == ["flushed", "True"], err
            assert "relay could not keep the batch for upstream" in err and "store write failed" not in err
            assert wait_until(lambda: stored_indices(cloud.store, "camera") == list(range(20)), 30)
        finally:
            assert relay.stop() == 0
    said = [line for line in relay.stderr_lines if "for upstream" in line]
    assert len(said) == 2 and "could not keep a batch" in said[0], said   # each retry's file was a new failure
    failed = int(said[1].split("after ")[1].split()[0])
    assert "batches are kept for upstream again" in said[1] and failed >= 2, said


def test_a_relay_forwarding_to_itself_is_refused_at_start(tmp_path):
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "crosstrace", "collector", "--store", str(tmp_path / "s.db"),
                          "--listen", f"127.0.0.1:{port}", "--forward-to", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "own --listen address" in out.stderr, out.stderr
    assert not (tmp_path / "s.db").exists()
    # A relay's options without --forward-to were taken, and did nothing.
    out = subprocess.run([sys.executable, "-m", "crosstrace", "collector", "--store", str(tmp_path / "s.db"),
                          "--listen", "127.0.0.1:0", "--spool-max-mb", "10"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--spool-max-mb goes with --forward-to" in out.stderr, out.stderr
    assert not (tmp_path / "s.db").exists()


def test_a_batch_too_large_once_marked_is_refused_before_the_relay_acks_it(tmp_path):
    """A batch just under gRPC's limit took the relay's mark on its way up, went over it,
    and upstream refused it: the relay had acked it, and dropped it. It is refused now,
    before it is kept, and the next batch goes up."""
    from crosstrace.proto import MAX_MESSAGE_BYTES
    from .test_collector_input import batch, export

    big = batch(1, attributes_json=b'[{"jpeg": ""}]')
    big.attributes_json = b'[{"jpeg": "' + b"x" * (MAX_MESSAGE_BYTES - 16 - big.ByteSize()) + b'"}]'
    assert MAX_MESSAGE_BYTES - 16 <= big.ByteSize() <= MAX_MESSAGE_BYTES
    with CollectorProcess(str(tmp_path / "cloud.db")) as cloud, \
            CollectorProcess(str(tmp_path / "gateway.db"), extra_args=("--forward-to", cloud.address)) as relay:
        acks, err = export(relay.address, [big.SerializeToString()], timeout=60)
        assert not acks and err.code().name == "RESOURCE_EXHAUSTED" and "once marked for upstream" in err.details()
        acks, err = export(relay.address, [batch(3, seq=2, first_id=10).SerializeToString()])
        assert err is None and acks[0].accepted == 3
        assert wait_until(lambda: sorted(load_table(cloud.store).span_id.tolist()) == [10, 11, 12], 30)
        assert sorted(load_table(relay.store).span_id.tolist()) == [10, 11, 12]   # not kept at the gateway either
