"""One grammar for a duration wherever a user writes one (budget limits, --last, --retain):
a number and a unit, ns, us (µs), ms, s, min, h or d. Two grammars took "90s" in both
places but "250us" only in a budget and "2h" only on the command line. And one way to
print one: the report printed "28.4 ms" and the budget check "28.4ms"."""
import math
import re

UNITS_NS = {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9, "min": 60e9, "h": 3600e9, "d": 86400e9}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ns|us|µs|ms|s|min|h|d)\s*$")


def parse_ns(text) -> float | None:
    """ns of "800ns", "250us", "1.5s", "15min", "7d"; None for anything else."""
    m = _DURATION.match(text) if isinstance(text, str) else None
    return float(m.group(1)) * UNITS_NS[m.group(2)] if m else None


def _unit_of(ns: float) -> tuple[str, float]:
    """The largest unit up to seconds that ns reaches, and its size in ns."""
    for unit in ("s", "ms", "us"):
        if abs(ns) >= UNITS_NS[unit]:
            return unit, UNITS_NS[unit]
    return "ns", 1


def format_ns(ns, digits: int = 3, sep: str = " ") -> str:
    """ns in the largest unit up to seconds that it reaches, to `digits` significant digits
    ("28.4 ms", "950 ns"; whole units from 10**(digits-1) on: "1234 s"); "-" for None.
    sep="" writes it as a budget file does ("5ms")."""
    if ns is None:
        return "-"
    ns = float(round(float(f"{float(ns):.{digits}g}")))   # rounded first: 999,999 ns is "1 ms", not "1000 us"
    unit, scale = _unit_of(ns)
    value = ns / scale
    return f"{value:.{digits}g}{sep}{unit}" if abs(value) < 10 ** (digits - 1) else f"{value:.0f}{sep}{unit}"


def format_within(ns, bound_ns) -> str:
    """ns to the digit its error bound reaches ("3.000161 s" known to 6 us, where format_ns
    says "3 s"): an offset told apart from the injected one, or from yesterday's."""
    if ns is None or not bound_ns or abs(ns) < 1e3:
        return format_ns(ns)
    step = 10 ** math.floor(math.log10(bound_ns))
    ns = round(ns / step) * step   # rounded first, as format_ns
    unit, scale = _unit_of(ns)
    decimals = min(9, max(0, math.ceil(math.log10(scale / bound_ns))))
    return f"{ns / scale:.{decimals}f} {unit}"
