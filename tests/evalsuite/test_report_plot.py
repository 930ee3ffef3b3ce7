"""The report plot stays readable with many slices, and both panels say what they plot.

Before, the slices' panel was 9 inches whatever their count: about 85 slices (5 domains x
3 difficulties x 3 context buckets, and traps) ran their rotated 7-pt labels into one
another. Now the panel grows with the slices, so the gap across two neighbouring
(parallel, rotated) labels is at least a label's height; the right panel's y axis is
labelled as the left's.
"""

from __future__ import annotations

import math
import random

import pytest

from components.core.records import EvalResult
from components.evalsuite.report import plot, slices


def results(domains: int) -> list[EvalResult]:
    rng = random.Random(0)
    out = []
    for d in ["math", "code", "terminal", "extraction", "structured"][:domains]:
        for i in range(200):
            out.append(EvalResult(task_id=f"{d}-{i}", domain=d, difficulty=rng.choice([1, 2, 3]),
                                  context_bucket=rng.choice(["<=32", "<=128", "<=512"]), policy_version="v",
                                  score=0.0, passed=rng.random() < 0.3, trap=rng.random() < 0.1))
    return out


def label_gaps(fig) -> tuple[float, float]:
    """(the smallest gap across two neighbouring slice labels, the tallest label), in pixels."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    right = fig.axes[1]
    labels = right.get_xticklabels()
    xs = [right.transData.transform((x, 0))[0] for x in right.get_xticks()]
    across = min(b - a for a, b in zip(xs, xs[1:])) * math.sin(math.radians(labels[0].get_rotation()))
    tallest = max(renderer.get_text_width_height_descent(t.get_text(), t.get_fontproperties(), ismath=False)[1]
                  for t in labels)
    return across, tallest


@pytest.mark.parametrize("domains", [1, 5])
def test_the_slice_labels_do_not_overlap(domains) -> None:
    import matplotlib.pyplot as plt

    rows = slices(results(domains))
    fig = plot(rows)
    across, tallest = label_gaps(fig)
    assert across >= tallest, (len(rows), across, tallest)
    assert fig.axes[1].get_ylabel() == fig.axes[0].get_ylabel() == "pass@1"
    plt.close(fig)


def test_the_figure_widens_with_many_slices_only() -> None:
    import matplotlib.pyplot as plt

    few, many = slices(results(1)), slices(results(5))
    assert len(few) < 30 and len(many) >= 80
    small, large = plot(few), plot(many)
    assert small.get_figwidth() == 12.0  # as before, for a plot of few slices
    assert large.get_figwidth() > 15.0
    plt.close(small)
    plt.close(large)
