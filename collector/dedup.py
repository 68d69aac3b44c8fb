"""Span-level deduplication over a window of recently stored spans.

Each span is reduced to a 64-bit key, a hash of (trace_id, span_id); the keys of the
last `capacity` spans are kept as a few sorted runs merged like a binary counter (an
LSM), so that checking a batch of n spans costs O(n log) in numpy, with no per-span
Python and no per-span database row. Two different spans share a key with odds of
about capacity / 2^64 (1e-12 for 8M keys).

Batches from crosstrace tracers are also deduplicated exactly, whatever their age, by
(session, seq) in the store; the window catches the rest (OTLP retries, a span that
arrives by two paths).
"""
import numpy as np

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def span_keys(trace_hi: np.ndarray, trace_lo: np.ndarray, span_id: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit key per (trace_id, span_id) (splitmix64 finaliser)."""
    with np.errstate(over="ignore"):
        x = trace_hi * _M1 ^ trace_lo * _M2 ^ span_id
        x ^= x >> np.uint64(30)
        x *= _M2
        x ^= x >> np.uint64(27)
        x *= _M3
        x ^= x >> np.uint64(31)
    return x


class RecentKeys:
    """Sorted runs of keys, oldest first; sizes grow towards the oldest (binary counter), up
    to a quarter of the capacity each: forgetting the oldest run then keeps at least three
    quarters of the window (with one run of everything, it kept only the newest batch)."""

    def __init__(self, capacity: int = 8_000_000):
        self.capacity = capacity
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for run in self.runs:
            pos = np.searchsorted(run, keys)
            pos[pos == len(run)] = 0
            found |= run[pos] == keys
        return found

    def add(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        run = np.sort(keys)
        most = max(self.capacity // 4, len(run))
        while self.runs and len(self.runs[-1]) <= len(run) and len(self.runs[-1]) + len(run) <= most:
            run = np.sort(np.concatenate([self.runs.pop(), run]), kind="stable")
        self.runs.append(run)
        while len(self) > self.capacity and len(self.runs) > 1:
            self.runs.pop(0)  # forget the oldest spans
