"""Names of monotonic clocks, so that readings of two different clocks are never taken for one.

A monotonic clock starts again at each boot of its machine, and a simulated one (tests, the
demo) is the machine's with an offset and a drift. Tracers name theirs in their Resource
(label `clock`); a collector names its own in its store.
"""
import hashlib


def boot_id() -> str:
    """This boot of this machine: its monotonic clock starts again at the next one. Empty
    where the system does not say (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def clock_domain(simulated: str = "") -> str:
    """The name of this machine's monotonic clock in this boot, or of a clock simulated on
    it (`simulated`: the simulation's parameters)."""
    return "monotonic:" + hashlib.blake2b(f"{boot_id()}|{simulated}".encode(), digest_size=8).hexdigest()
