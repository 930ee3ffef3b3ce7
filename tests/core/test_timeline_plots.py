"""The timeline plots stay readable on a long-running pipeline.

Before, both plots put one x tick label per iteration (60 iterations: 60 labels running
into each other) and pass@1's y range was exactly 0..1, so a domain stuck at 0 or 1 lay
on the frame. Now up to ``MAX_TICKED_ITERATIONS`` iterations are each labelled, beyond
that matplotlib picks integer ticks, and the y range has a small margin.
"""

from __future__ import annotations

import pytest

from components.core import timeline
from components.core.timeline import MAX_TICKED_ITERATIONS, Scores


def scores(n: int) -> list[Scores]:
    return [Scores(k, {"a": 0.5, "b": 0.0, "c": 1.0}, 8) for k in range(n)]


def rewards(n: int) -> list[tuple[int, dict[str, float]]]:
    return [(k, {"code": 0.1 * (k % 10)}) for k in range(1, n + 1)]


def ticks(fig) -> list[float]:
    fig.canvas.draw()
    ax = fig.axes[0]
    low, high = ax.get_xlim()
    return [t for t in ax.get_xticks() if low <= t <= high]


@pytest.mark.parametrize(("draw", "first"), [(lambda n: timeline.plot(scores(n), "p"), 0),
                                             (lambda n: timeline.plot_rewards(rewards(n), "p"), 1)],
                         ids=["pass_rates", "rewards"])
def test_a_long_pipeline_gets_a_few_integer_ticks_and_a_short_one_one_per_iteration(draw, first: int) -> None:
    import matplotlib.pyplot as plt

    long = draw(60)
    shown = ticks(long)
    assert 2 <= len(long.axes[0].get_xticks()) <= 15
    assert all(float(t).is_integer() for t in shown)
    plt.close(long)
    short = draw(5)
    assert list(short.axes[0].get_xticks()) == list(range(first, first + 5))
    plt.close(short)
    edge = draw(MAX_TICKED_ITERATIONS)
    assert len(edge.axes[0].get_xticks()) == MAX_TICKED_ITERATIONS
    plt.close(edge)


def test_a_domain_at_0_or_1_lies_inside_the_frame() -> None:
    import matplotlib.pyplot as plt

    fig = timeline.plot(scores(3), "p")
    low, high = fig.axes[0].get_ylim()
    assert low < 0.0 and high > 1.0
    assert (low, high) == pytest.approx((-0.02, 1.02))
    plt.close(fig)
