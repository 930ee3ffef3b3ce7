"""Statistics of the eval suite against known values: Wilson intervals, the paired
bootstrap of a pass-rate difference, and the unbiased pass@k estimator."""

from __future__ import annotations

import numpy as np
import pytest

from components.evalsuite.stats import paired_bootstrap, pass_at_k, wilson, z_value


@pytest.mark.parametrize(("passed", "tasks", "confidence", "low", "high"), [
    (8, 10, 0.95, 0.4902, 0.9433),  # the textbook example (Wilson 1927; Newcombe 1998)
    (0, 10, 0.95, 0.0, 0.2775),  # no success: the interval still has width
    (10, 10, 0.95, 0.7225, 1.0),
    (120, 200, 0.95, 0.5308, 0.6654),
    (120, 200, 0.99, 0.5089, 0.6846),  # a higher confidence: wider
    (0, 0, 0.95, 0.0, 1.0),  # an empty slice says nothing
])
def test_wilson(passed, tasks, confidence, low, high):
    lo, hi = wilson(passed, tasks, confidence)
    assert (round(float(lo), 4), round(float(hi), 4)) == (low, high)


def test_wilson_is_vectorised_and_z_is_the_normal_quantile():
    lo, hi = wilson([8, 0], [10, 10])
    assert np.round(lo, 4).tolist() == [0.4902, 0.0] and np.round(hi, 4).tolist() == [0.9433, 0.2775]
    assert round(z_value(0.95), 5) == 1.95996


def paired(n: int, both: int, only_candidate: int, only_baseline: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-task outcomes of two policies on ``n`` tasks: ``both`` pass for both, then the
    tasks only the candidate passes, then those only the baseline passes."""
    c = np.zeros(n)
    b = np.zeros(n)
    c[:both] = b[:both] = 1
    c[both:both + only_candidate] = 1
    b[both + only_candidate:both + only_candidate + only_baseline] = 1
    return c, b


def test_identical_outcomes_have_a_zero_width_interval():
    c, b = paired(200, 100, 0, 0)
    assert paired_bootstrap(c, b, 0.95, 2000, 1) == (0.0, 0.0, 0.0)


def test_a_real_regression_lies_entirely_below_zero():
    c, b = paired(200, 60, 0, 60)  # 0.60 -> 0.30
    diff, low, high = paired_bootstrap(c, b, 0.95, 2000, 1)
    assert diff == pytest.approx(-0.30)
    assert (low, high) == (-0.365, -0.235)  # seeded: the same numbers on every machine
    # the normal approximation: -0.30 +- 1.96 * sqrt(0.3 * 0.7 / 200) = [-0.364, -0.236]
    assert low == pytest.approx(-0.364, abs=0.005) and high == pytest.approx(-0.236, abs=0.005)


def test_a_noise_level_dip_straddles_zero():
    c, b = paired(200, 80, 12, 20)  # 0.50 -> 0.46: 32 discordant tasks
    diff, low, high = paired_bootstrap(c, b, 0.95, 2000, 7)
    assert diff == pytest.approx(-0.04)
    sd = np.sqrt((32 / 200 - 0.04**2) / 200)  # the paired normal approximation
    assert low == pytest.approx(-0.04 - 1.96 * sd, abs=0.006) and high == pytest.approx(-0.04 + 1.96 * sd, abs=0.006)
    assert low < 0 < high


def test_the_multinomial_draw_is_the_bootstrap_over_task_indices():
    """Resampling task indices (the textbook paired bootstrap) gives the same interval."""
    c, b = paired(150, 40, 25, 15)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 150, size=(20000, 150))
    by_index = np.quantile((c - b)[idx].mean(axis=1), [0.025, 0.975])
    _, low, high = paired_bootstrap(c, b, 0.95, 20000, 0)
    assert low == pytest.approx(by_index[0], abs=0.004) and high == pytest.approx(by_index[1], abs=0.004)


def test_the_same_seed_gives_the_same_interval_and_another_may_not():
    c, b = paired(200, 80, 12, 20)
    # numpy's default_rng(3) draws the same on every machine: the interval is pinned, so a
    # change to how the resamples are drawn shows here (a baseline comparison moves with it)
    assert paired_bootstrap(c, b, 0.95, 500, 3) == pytest.approx((-0.04, -0.092625, 0.015), abs=1e-12)
    assert paired_bootstrap(c, b, 0.95, 500, 3) != paired_bootstrap(c, b, 0.95, 500, 4)


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (10, 3, 1, 0.3),  # pass@1 is the share of correct samples
    (10, 0, 5, 0.0),
    (10, 6, 5, 1.0),  # fewer than k failures: some draw of k always passes
    (4, 1, 4, 1.0),  # n = k: pass@k is "any sample passed"
    (4, 0, 4, 0.0),
    (200, 50, 10, 1 - np.prod(1 - 10 / np.arange(151, 201))),
])
def test_pass_at_k(n, c, k, expected):
    assert float(pass_at_k(n, c, k)) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_per_task_array():
    assert pass_at_k(4, np.array([0, 1, 2, 4]), 2).round(4).tolist() == [0.0, 0.5, 0.8333, 1.0]
