"""The node's clock: every time the tracer records (spans, clock samples) comes from here.

Spans are stamped with the local monotonic clock, never wall time, so that NTP steps
cannot corrupt durations. For tests and the demo a process can run a simulated clock
with an injected offset and drift; the collector must recover them from clock samples
alone, so the injected values are never sent.
"""
import time

from ..clock_sync.domain import clock_domain

_monotonic_ns = time.monotonic_ns


class Clock:
    """local(t) = t + offset_ns + (t - epoch_ns) * ppb // 1e9, t the real monotonic time and ppb
    the drift in whole parts per billion (round(drift_ppm * 1000)): integer arithmetic, so a
    reading is exact however long the process runs."""

    __slots__ = ("offset_ns", "drift_ppm", "epoch_ns", "now", "_drift_ppb", "_wall_to_monotonic", "_wall_read_at")

    def __init__(self, offset_ns: int = 0, drift_ppm: float = 0.0, epoch_ns: int | None = None):
        self.offset_ns = int(offset_ns)
        self.drift_ppm = float(drift_ppm)
        self.epoch_ns = _monotonic_ns() if epoch_ns is None else int(epoch_ns)
        self._drift_ppb = round(self.drift_ppm * 1000)
        self._wall_read_at = None
        if not self.offset_ns and not self.drift_ppm:
            self.now = _monotonic_ns  # the hot path calls the C function directly
            return
        at = self.at

        def now() -> int:
            return at(_monotonic_ns())

        self.now = now

    @property
    def simulated(self) -> bool:
        return self.now is not _monotonic_ns

    def domain(self) -> str:
        """Which clock this is, for the collector (Resource label `clock`): the machine's
        boot, where the monotonic clock starts again, and the simulated offset and drift.
        A node id that comes back on another clock (a rebooted machine, a pod rescheduled
        under its name) is then kept apart from the one it had."""
        simulated = f"{self.offset_ns}/{self.drift_ppm}/{self.epoch_ns if self._drift_ppb else ''}" \
            if self.simulated else ""   # without drift the epoch does not change the clock
        return clock_domain(simulated)

    def at(self, t: int) -> int:
        """This clock's reading at the real monotonic time t."""
        return t + self.offset_ns + (t - self.epoch_ns) * self._drift_ppb // 1_000_000_000

    def offset_at_local(self, local):
        """The offset (this clock - true time) when it read `local` (a number or a numpy
        array): the truth that the collector's recovery of a simulated clock is checked
        against, at the instant of a reading it reports."""
        true = self.epoch_ns + (local - self.offset_ns - self.epoch_ns) / (1 + self._drift_ppb / 1e9)
        return self.offset_ns + (true - self.epoch_ns) * self._drift_ppb / 1e9

    def from_epoch_ns(self, epoch_ns: int) -> int:
        """Map a wall-clock time (ns since the Unix epoch, as OpenTelemetry passes
        explicit start/end times) onto this clock. The wall and monotonic clocks run at one
        rate (NTP slews both) and part only when the wall clock is stepped, so their
        difference is read at most once a second: times given together keep their
        differences exactly (a pair of clock readings per time was off by about 1 us),
        and a step of the wall clock is taken in within a second."""
        t = _monotonic_ns()
        try:   # int: a float (time.time() * 1e9) was kept, and its event then left out of every export
            epoch_ns = int(epoch_ns)
        except (TypeError, ValueError, OverflowError):   # not a time: now, as where none is given
            return self.at(t)
        if self._wall_read_at is None or t - self._wall_read_at > 1_000_000_000:
            self._wall_to_monotonic = t - time.time_ns()
            self._wall_read_at = t
        return self.at(epoch_ns + self._wall_to_monotonic)
