"""A node's clock model: how its local clock maps onto the reference timeline.

offset(t) = local - reference, as a line in local time t: offset_ns at local time
at_ns, changing by drift_ppm. Positive offset: the node's clock is ahead. Every
mapped time carries the model's error bound.
"""
import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class ClockModel:
    offset_ns: float
    drift_ppm: float
    at_ns: int                 # local time at which offset_ns holds
    error_ns: float            # bound on |true offset - offset(t)| within the fitted window
    samples: int = 0
    sources: tuple = ()
    flags: tuple = ()

    def offset_at(self, local):
        return self.offset_ns + self.drift_ppm * 1e-6 * (np.asarray(local, dtype=np.float64) - self.at_ns)

    def to_reference(self, local) -> np.ndarray:
        """Reference-time ns (int64) for local-time ns."""
        local = np.asarray(local, dtype=np.int64)
        return local - np.rint(self.offset_at(local)).astype(np.int64)

    @property
    def known(self) -> bool:
        return math.isfinite(self.error_ns)


def unknown(samples: int = 0) -> ClockModel:
    """No usable samples: identity mapping with an unbounded error."""
    return ClockModel(0.0, 0.0, 0, math.inf, samples, (), ("no_samples",))
