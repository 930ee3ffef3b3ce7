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
