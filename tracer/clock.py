"""The node's clock: every time the tracer records (spans, clock samples) comes from here.

Spans are stamped with the local monotonic clock, never wall time, so that NTP steps
cannot corrupt durations. For tests and the demo a process can run a simulated clock
with an injected offset and drift; the collector must recover them from clock samples
alone, so the injected values are never sent.
"""
import time

_monotonic_ns = time.monotonic_ns


class Clock:
    """local(t) = t + offset_ns + drift_ppm * 1e-6 * (t - epoch_ns), t the real monotonic time."""

    __slots__ = ("offset_ns", "drift_ppm", "epoch_ns", "now")

    def __init__(self, offset_ns: int = 0, drift_ppm: float = 0.0, epoch_ns: int | None = None):
        self.offset_ns = int(offset_ns)
        self.drift_ppm = float(drift_ppm)
        self.epoch_ns = _monotonic_ns() if epoch_ns is None else int(epoch_ns)
        if not self.offset_ns and not self.drift_ppm:
            self.now = _monotonic_ns  # the hot path calls the C function directly
            return
        offset, epoch = self.offset_ns, self.epoch_ns
        drift_ppb = round(self.drift_ppm * 1000)

        def now() -> int:
            t = _monotonic_ns()
            return t + offset + (t - epoch) * drift_ppb // 1_000_000_000

        self.now = now

    @property
    def simulated(self) -> bool:
        return self.now is not _monotonic_ns

    def from_epoch_ns(self, epoch_ns: int) -> int:
        """Map a wall-clock time (ns since the Unix epoch, as OpenTelemetry passes
        explicit start/end times) onto this clock."""
        return self.now() + (epoch_ns - time.time_ns())
