"""The PTP source against real ptp4l: a master and a slave in two network namespaces joined
by a veth pair, software timestamping, free_running (they measure, never adjust the
clock), read through pmc on the slave's UNIX socket."""
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from crosstrace.clock_sync import ptp
from crosstrace.collector.align import fit_models
from crosstrace.collector.store import Store
from crosstrace.proto import pb

from .conftest import local_minus_wall, run_python, tracer_env

PTP_CONF = """[global]
time_stamping software
free_running 1
network_transport UDPv4
logSyncInterval -3
logAnnounceInterval -2
announceReceiptTimeout 2
uds_address {uds}
{extra}
"""


def _ip(*args) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@pytest.fixture(scope="module")
def ptp_slave_uds(tmp_path_factory):
    """The slave ptp4l's UNIX socket, once it has a grandmaster and a Sync."""
    for tool in ("ptp4l", "pmc", "ip"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed (Debian packages linuxptp, iproute2)")
    tmp = tmp_path_factory.mktemp("ptp")
    tag = f"ct{os.getpid() % 100000}"
    master_ns, slave_ns = f"{tag}m", f"{tag}s"
    try:
        _ip("netns", "add", master_ns)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}")
    procs, logs = [], []
    try:
        _ip("netns", "add", slave_ns)
        _ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        for ns, dev, addr in ((master_ns, f"{tag}a", "198.18.7.1/24"), (slave_ns, f"{tag}b", "198.18.7.2/24")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        uds = {}
        for role, ns, dev, extra in (("master", master_ns, f"{tag}a", "priority1 1"),
                                     ("slave", slave_ns, f"{tag}b", "slaveOnly 1")):
            uds[role] = str(tmp / f"{role}.sock")
            conf = tmp / f"{role}.conf"
            conf.write_text(PTP_CONF.format(uds=uds[role], extra=extra))
            log = open(tmp / f"{role}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "ptp4l", "-i", dev, "-f", str(conf), "-m"],
                                          stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while True:
            try:
                ptp.query(uds["slave"], lambda t: t, timeout_s=2)
                break
            except ptp.PtpError as exc:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    for log in logs:
                        log.flush()
                    pytest.fail(f"ptp4l slave never synchronised ({exc}):\n"
                                + (tmp / "slave.log").read_text()[-1500:] + (tmp / "master.log").read_text()[-800:])
                time.sleep(0.3)
        yield uds["slave"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for log in logs:
            log.close()
        for ns in (master_ns, slave_ns):      # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_pmc_readings_bound_the_node_clock(ptp_slave_uds):
    offset = -180_000_000

    def now():
        return time.monotonic_ns() + offset

    for _ in range(5):
        s = ptp.query(ptp_slave_uds, lambda t: t + offset)
        # Both ptp4l run on this kernel's CLOCK_REALTIME: the master's time is the wall clock.
        true_local_minus_master, known_to = local_minus_wall(now)
        assert abs(-s.ref_minus_local_ns - true_local_minus_master) <= s.error_ns + known_to + 20_000
        assert s.server.startswith("ptp:") and 0 < s.error_ns < 1_000_000
        time.sleep(0.15)


def test_a_missing_ptp4l_socket_is_a_clear_error(tmp_path):
    with pytest.raises(ptp.PtpError):
        ptp.query(str(tmp_path / "nothing.sock"), lambda t: t, timeout_s=2)


def test_tracer_ptp_samples_reach_the_model(collector, ptp_slave_uds):
    epoch = time.monotonic_ns()
    env = tracer_env(collector, "ptp-node", ptp_uds=ptp_slave_uds, ptp_interval_s=0.2, clock_probe_interval_s=0.3,
                     sim_clock_offset_ns=90_000_000, sim_clock_drift_ppm=30.0, sim_clock_epoch_ns=epoch)
    run_python("import time, crosstrace; p = crosstrace.init(); time.sleep(2.5); p.shutdown()", env)
    collector.stop()
    store = Store(collector.store, readonly=True)
    try:
        rows = store.clock_samples()
        model = fit_models(store)["ptp-node"]
    finally:
        store.close()
    assert sum(r[1] == pb.PTP for r in rows) >= 3
    assert any(s.startswith("ptp:") for s in model.sources), model
    assert not any(f.startswith("falseticker") for f in model.flags)
    t = np.array([r[7] for r in rows if r[1] == pb.PTP], dtype=np.int64)    # where the PTP readings were taken
    assert len(t) >= 3
    ppb = 30_000
    true = 90_000_000 + ((t - 90_000_000 - epoch) / (1 + ppb / 1e9)) * ppb / 1e9
    lo, hi = model.bounds_at(t)
    assert np.all((lo <= true + 1) & (true - 1 <= hi))

