"""SFT domain balancing: weak domains get the steps, none is dropped."""

from __future__ import annotations

import pytest

from components.bootstrap.stage import balance_weights


@pytest.mark.parametrize(
    ("rates", "high", "expected"),
    [
        ([0.0, 0.5], 0.5, [0.5, 0.05]),
        ([0.1, 0.3, 0.9], 0.5, [0.4, 0.2, 0.05]),
        ([0.0, 0.0], 0.5, [0.5, 0.5]),
        ([1.0], 0.2, [0.05]),
    ],
)
def test_weights_follow_the_gap_to_the_band_top(rates, high, expected):
    assert balance_weights(rates, high) == pytest.approx(expected)


@pytest.mark.parametrize(("lengths", "budget", "kept"), [
    ([(3, 2)] * 10, 0, 10),  # no cap
    ([(3, 2)] * 10, 25, 5),  # 5 examples x 5 tokens
    ([(3, 2), (3, 2), (10, 2), (3, 2)], 30, 2),  # the long third example would pad the batch to 3 x 12 = 36
    ([(40, 2), (3, 2)], 10, 1),  # always at least one example
    ([(3, 2)] * 4, 1000, 4),
])
def test_token_budget_keeps_the_longest_prefix_that_fits(lengths, budget, kept):
    from components.bootstrap.stage import token_budget

    examples = [([1] * p, [2] * c, [1] * c) for p, c in lengths]
    assert token_budget(examples, budget) == examples[:kept]
