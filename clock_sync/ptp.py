"""PTP source: read linuxptp's view of this node's clock through `pmc` on ptp4l's UNIX
socket, and turn it into a bounded sample of the node's offset to the PTP master.

TIME_STATUS_NP gives master_offset (the port's clock minus the master's, ns) and the
ingress time of the Sync it was measured from; CURRENT_DATA_SET gives meanPathDelay.
PTP assumes a symmetric path, so the offset is known to within the one-way delay: that
is the bound. With software timestamping (and free_running, where ptp4l only measures)
ptp4l's clock is CLOCK_REALTIME, which relates the reading to the node's clock.
"""
import re
import subprocess
import time

from .exchange import OffsetSample

_FIELD = re.compile(r"^\s+(\w+)\s+(\S+)\s*$")


class PtpError(Exception):
    """No usable reading from ptp4l; the message says why."""


def read_pmc(uds: str, timeout_s: float = 1.0, domain: int = 0) -> dict[str, str]:
    """Fields of TIME_STATUS_NP and CURRENT_DATA_SET as pmc prints them."""
    cmd = ["pmc", "-u", "-b", "0", "-d", str(domain), "-s", uds,
           "GET TIME_STATUS_NP", "GET CURRENT_DATA_SET"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise PtpError("pmc not found: install linuxptp") from None
    except subprocess.TimeoutExpired:
        raise PtpError(f"pmc on {uds} did not answer within {timeout_s} s") from None
    fields = {}
    for line in out.stdout.splitlines():
        match = _FIELD.match(line)
        if match:
            fields[match.group(1)] = match.group(2)
    if "master_offset" not in fields or "meanPathDelay" not in fields:
        raise PtpError(f"no answer from ptp4l at {uds} (pmc exit {out.returncode}): "
                       f"{(out.stderr or out.stdout).strip()[:200]}")
    return fields


def sample_from_fields(fields: dict[str, str], local_at, realtime_ns=time.time_ns,
                       monotonic_ns=time.monotonic_ns) -> OffsetSample:
    """A sample from pmc's fields; `local_at(t)` is the node's clock at monotonic time t,
    `realtime_ns()` the clock ptp4l timestamps with. The offset was measured at the Sync's
    ingress, a realtime instant: the node's clock is read at that instant through the
    monotonic clock, which runs at realtime's rate (NTP slews both), so a node clock that
    drifts (a simulated one) is read where the offset was measured, not when pmc answered."""
    if fields.get("gmPresent") != "true":
        raise PtpError("ptp4l has no grandmaster yet")
    try:
        master_offset = int(fields["master_offset"])              # ptp clock - master
        path_delay = abs(float(fields["meanPathDelay"]))
        ingress = int(fields["ingress_time"])
    except (KeyError, ValueError) as exc:
        raise PtpError(f"pmc's answer lacks a usable field: {exc!r}") from None
    if ingress <= 0:
        raise PtpError("ptp4l has not received a Sync yet")
    before = realtime_ns()
    monotonic = monotonic_ns()
    after = realtime_ns()
    local = local_at(monotonic - ((before + after) // 2 - ingress))
    return OffsetSample(local_ns=local, ref_minus_local_ns=ingress - master_offset - local,
                        error_ns=int(path_delay) + (after - before) + 1,
                        server=f"ptp:{fields.get('gmIdentity', '?')}")


def query(uds: str, local_at, timeout_s: float = 1.0, domain: int = 0) -> OffsetSample:
    return sample_from_fields(read_pmc(uds, timeout_s, domain), local_at)
