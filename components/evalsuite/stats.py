"""Statistics of eval-suite pass rates: Wilson intervals, a paired bootstrap, pass@k.

- ``wilson(passed, tasks, confidence)`` (from :mod:`components.core.intervals`, which the
  timeline plot shares): the Wilson score interval of a pass rate, vectorised; the
  layered report puts one on every slice.
- ``paired_bootstrap(candidate, baseline, confidence, resamples, seed)``: the difference of
  two policies' pass rates on the *same* tasks (``candidate[i]`` and ``baseline[i]`` are
  one task's outcomes) and its percentile interval. Resampling tasks with replacement
  only changes how many tasks of each kind (-1, 0, +1 per-task difference) are drawn, so
  each resample is one multinomial draw of those three counts: exactly the bootstrap over
  task indices, in O(resamples) memory whatever the suite's size.
- ``pass_at_k(samples, correct, k)``: the unbiased pass@k estimator of Chen et al. (2021),
  ``1 - C(n-c, k) / C(n, k)`` per task (a product of k factors in log1p: no large binomials).

Example::

    >>> from components.evalsuite.stats import wilson, pass_at_k
    >>> [round(float(x), 4) for x in wilson(8, 10, 0.95)]
    [0.4902, 0.9433]
    >>> round(float(pass_at_k(10, 3, 5)), 4)
    0.9167

Not covered: multiple-comparison corrections across domains (each domain's interval is
at the stated confidence on its own), or intervals for mean scores (only pass rates).
"""

from __future__ import annotations

import zlib

import numpy as np

from components.core.intervals import wilson, z_value

__all__ = ["domain_seed", "paired_bootstrap", "pass_at_k", "wilson", "z_value"]


def domain_seed(seed: int, domain: str) -> np.random.Generator:
    """A generator for one domain's resamples: independent of which other domains exist."""
    return np.random.default_rng([seed, zlib.crc32(domain.encode())])


def paired_bootstrap(candidate, baseline, confidence: float, resamples: int,
                     rng: np.random.Generator | int) -> tuple[float, float, float]:
    """(difference, low, high): the pass-rate difference candidate - baseline over paired
    tasks and its percentile bootstrap interval at ``confidence``."""
    c = np.asarray(candidate, dtype=float)
    b = np.asarray(baseline, dtype=float)
    assert c.shape == b.shape and c.ndim == 1, "paired outcomes: one candidate and one baseline outcome per task"
    n = c.size
    if n == 0:
        return 0.0, 0.0, 0.0
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    d = c - b
    values = np.array([-1.0, 0.0, 1.0])
    shares = np.array([(d < 0).sum(), (d == 0).sum(), (d > 0).sum()], dtype=float) / n
    counts = gen.multinomial(n, shares, size=resamples)  # one row per resample of n tasks
    diffs = counts @ values / n
    alpha = (1 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    return float(d.mean()), float(low), float(high)


def pass_at_k(samples, correct, k: int) -> np.ndarray:
    """Unbiased pass@k per task from ``samples`` completions of which ``correct`` passed
    (arrays broadcast; ``k <= samples``): ``1 - C(n-c, k) / C(n, k)``, the ratio taken as
    the product of ``1 - c / (n - i)`` for i < k, summed in ``log1p`` and turned back with
    ``expm1``, so that no binomial is ever formed and a small pass@k keeps its digits
    (log-gamma differences lost about 2e-9 of 0.001)."""
    n, c = np.broadcast_arrays(np.asarray(samples, dtype=float), np.asarray(correct, dtype=float))
    assert k >= 1 and np.all(n >= k) and np.all((c >= 0) & (c <= n)), "pass@k needs 0 <= correct <= samples and k <= samples"
    rest = n - c
    with np.errstate(divide="ignore", invalid="ignore"):  # where rest < k a factor is 0: that task's pass@k is 1
        log_ratio = sum(np.log1p(-c / (n - i)) for i in range(k))
    return np.where(rest < k, 1.0, -np.expm1(log_ratio))
