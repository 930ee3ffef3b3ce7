"""Confidence intervals of pass rates, shared by the eval suite's report and the timeline.

- ``z_value(confidence)``: the two-sided standard normal quantile.
- ``wilson(passed, tasks, confidence)``: the Wilson score interval, vectorised over
  arrays of counts (``passed`` may be fractional: a rate times its task count).

Not covered: intervals of anything but a proportion.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np


def z_value(confidence: float) -> float:
    """The two-sided standard normal quantile for ``confidence`` (1.95996... for 0.95)."""
    return NormalDist().inv_cdf(0.5 + confidence / 2)  # the stdlib's: scipy.stats costs 0.4 s to import


def wilson(passed, tasks, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of the Wilson score interval for ``passed`` successes out of ``tasks``;
    arrays broadcast. A slice of 0 tasks gets (0, 1): it says nothing."""
    k = np.asarray(passed, dtype=float)
    n = np.asarray(tasks, dtype=float)
    z = z_value(confidence)
    safe = np.where(n > 0, n, 1.0)
    p = k / safe
    denom = 1 + z * z / safe
    centre = (p + z * z / (2 * safe)) / denom
    half = z * np.sqrt(p * (1 - p) / safe + z * z / (4 * safe * safe)) / denom
    # the interval contains p; min/max only remove rounding (e.g. 1 - 1e-17 at p = 1)
    low = np.where(n > 0, np.clip(np.minimum(centre - half, p), 0.0, 1.0), 0.0)
    high = np.where(n > 0, np.clip(np.maximum(centre + half, p), 0.0, 1.0), 1.0)
    return low, high
