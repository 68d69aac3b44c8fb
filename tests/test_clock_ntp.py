"""The NTP source against a real chronyd serving on loopback (it never touches the system
clock: -x, local stratum 10, an unprivileged port, no command port)."""
import getpass
import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

from crosstrace.clock_sync import ntp
from crosstrace.collector.align import NodeSources, fit_models, fit_sources, node_sources
from crosstrace.collector.store import Store
from crosstrace.proto import pb

from .conftest import local_minus_wall, run_python, tracer_env

CHRONYD = shutil.which("chronyd") or "/usr/sbin/chronyd"


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def chronyd(tmp_path):
    """"127.0.0.1:PORT" of a chronyd serving its own clock, stopped after the test."""
    if not os.path.exists(CHRONYD):
        pytest.skip("chronyd not installed (Debian package chrony)")
    port = _free_udp_port()
    conf = tmp_path / "chrony.conf"
    conf.write_text(f"port {port}\nbindaddress 127.0.0.1\nlocal stratum 10\nallow 127.0.0.1\ncmdport 0\n"
                    f"pidfile {tmp_path}/chronyd.pid\ndriftfile {tmp_path}/chrony.drift\n")
    log = open(tmp_path / "chronyd.log", "w")
    proc = subprocess.Popen([CHRONYD, "-x", "-d", "-u", getpass.getuser(), "-f", str(conf)],
                            stdout=log, stderr=subprocess.STDOUT)
    server = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                ntp.query(server, time.monotonic_ns, timeout_s=0.2)
                break
            except ntp.NtpError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"chronyd did not serve: {(tmp_path / 'chronyd.log').read_text()[-2000:]}")
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def test_an_ntp_answer_bounds_the_node_clock_to_utc(chronyd):
    offset = 250_000_000                    # this "node" runs 0.25 s ahead of its monotonic clock

    def now():
        return time.monotonic_ns() + offset

    for _ in range(5):
        s = ntp.query(chronyd, now)
        # chronyd serves this machine's CLOCK_REALTIME: the truth is now() - the wall clock.
        true_local_minus_utc, known_to = local_minus_wall(now)
        assert abs(-s.ref_minus_local_ns - true_local_minus_utc) <= s.error_ns + known_to + 50_000
        assert 0 < s.error_ns < 10_000_000 and s.server == chronyd


def test_a_silent_server_is_a_clear_error():
    start = time.monotonic()
    with pytest.raises(ntp.NtpError, match="no answer"):
        ntp.query(f"127.0.0.1:{_free_udp_port()}", time.monotonic_ns, timeout_s=0.3)
    assert time.monotonic() - start < 5


def test_ntp_samples_align_a_node_that_only_has_ntp(collector, chronyd):
    """Node "both" has probes to the collector and NTP, which measures the UTC link; node
    "ntp-only" is then placed through NTP and that link, with bounds that add."""
    epoch = time.monotonic_ns()
    truth = {"both": (-300_000_000, 25.0), "ntp-only": (400_000_000, -15.0)}
    for node, (off, drift) in truth.items():
        env = tracer_env(collector, node, ntp_servers=chronyd, ntp_interval_s=0.2, clock_probe_interval_s=0.3,
                         sim_clock_offset_ns=off, sim_clock_drift_ppm=drift, sim_clock_epoch_ns=epoch)
        run_python("import time, crosstrace; p = crosstrace.init(); time.sleep(2.5); p.shutdown()", env)
    collector.stop()
    store = Store(collector.store, readonly=True)
    try:
        models = fit_models(store)
        nodes = {i: r.node_id for i, r in store.nodes().items()}
        rows = {n: [r for r in store.clock_samples() if nodes[r[0]] == n] for n in truth}
        epoch_offset = int(store.meta("epoch_offset_ns"))
    finally:
        store.close()
    assert any(r[1] == pb.NTP for r in rows["both"])
    both = models["both"]
    assert f"ntp:{chronyd}" in both.sources and not any(f.startswith("falseticker") for f in both.flags)
    assert "utc_link_assumed" not in both.flags
    # Drop the second node's direct probes: only NTP (through the link) is left to place it.
    full = node_sources(rows["ntp-only"])
    only_ntp = NodeSources({}, full.to_utc, {}, full.samples)
    placed = fit_sources({"both": node_sources(rows["both"]), "ntp-only": only_ntp}, epoch_offset)["ntp-only"]
    assert placed.known and placed.sources == (f"ntp:{chronyd}",)
    t = np.array([r[7] for r in rows["ntp-only"] if r[1] == pb.NTP], dtype=np.int64)
    assert len(t) >= 2
    off, drift = truth["ntp-only"]
    ppb = round(drift * 1000)
    true = off + ((t - off - epoch) / (1 + ppb / 1e9)) * ppb / 1e9
    lo, hi = placed.bounds_at(t)
    assert np.all((lo <= true + 1) & (true - 1 <= hi))
    direct = models["ntp-only"]
    assert placed.error_at(t).min() > direct.error_at(t).min()     # two hops: the bounds add up
