"""One grammar for a duration wherever a user writes one (budget limits, --last, --retain):
a number and a unit, ns, us (µs), ms, s, min, h or d. Two grammars took "90s" in both
places but "250us" only in a budget and "2h" only on the command line."""
import re

UNITS_NS = {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9, "min": 60e9, "h": 3600e9, "d": 86400e9}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ns|us|µs|ms|s|min|h|d)\s*$")


def parse_ns(text) -> float | None:
    """ns of "800ns", "250us", "1.5s", "15min", "7d"; None for anything else."""
    m = _DURATION.match(text) if isinstance(text, str) else None
    return float(m.group(1)) * UNITS_NS[m.group(2)] if m else None
