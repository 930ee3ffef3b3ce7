"""The layered evaluation report: pass rates by domain x difficulty x context-length bucket.

Trap tasks (a shortcut fails them; see each domain's docstring) form their own slices,
named with a ``/trap`` suffix, so a policy that learnt the shortcut shows up as a weak
slice instead of vanishing into its difficulty's average.

``slices(results)`` groups ``EvalResult`` rows into slices and ``weakest(rows)`` picks the
slice with the lowest pass rate among those with at least ``MIN_SLICE`` tasks (so one
unlucky task does not make a slice "weakest"; if no slice is that large, all count).
``log_layered(ctx, results)`` writes the table to the store (``layered.json``, a stage
output), logs it to MLflow as a table artifact (``<stage>/layered.json``, viewable in the
run's artifact UI) with a matplotlib plot (``<stage>/pass_rates.png``: pass rate per
domain, and per difficulty and context bucket within each domain), and returns the
weakest slice, which the stage keeps in its facts for ``posttrain run``'s table.

Every row carries ``ci_low``/``ci_high``: the Wilson score interval of its pass rate at
``evaluation.confidence`` (0.95 where no recipe is at hand), so a 3-task slice at 0.0 reads
as the wide interval it is; the plot draws them as error bars.

An MLflow error while logging the table or the plot (an artifact store that refuses
writes, a full disk, a figure that cannot be drawn) prints one line and the stage goes
on: the table is in the store either way, and the stage's metrics are logged apart.

Not covered: slices along other axes, intervals for mean scores, or retrying a failed
upload.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from components.core.errors import exc_line
from components.core.facts import Slice
from components.core.progress import say
from components.core.records import EvalResult
from components.evalsuite.stats import wilson

MIN_SLICE = 5


def slices(results: list[EvalResult], confidence: float = 0.95) -> list[dict[str, Any]]:
    """One row per (domain, difficulty, context bucket, trap), sorted by those keys, with
    the Wilson interval of its pass rate at ``confidence``."""
    groups: dict[tuple[str, int, str, bool], list[EvalResult]] = defaultdict(list)
    for r in results:
        groups[(r.domain, r.difficulty, r.context_bucket, r.trap)].append(r)
    rows = []
    order = sorted(groups, key=lambda key: (key[0], key[1], _bucket_order(key[2]), key[3]))
    for domain, difficulty, bucket, trap in order:
        rs = groups[(domain, difficulty, bucket, trap)]
        rows.append({"domain": domain, "difficulty": difficulty, "context_bucket": bucket, "trap": trap, "tasks": len(rs),
                     "passed": sum(r.passed for r in rs), "pass_rate": sum(r.passed for r in rs) / len(rs),
                     "mean_score": sum(r.score for r in rs) / len(rs)})
    low, high = wilson([r["passed"] for r in rows], [r["tasks"] for r in rows], confidence)
    for row, lo, hi in zip(rows, low.tolist(), high.tolist()):
        row["ci_low"], row["ci_high"] = lo, hi
    return rows


def _bucket_order(bucket: str) -> int:
    digits = "".join(c for c in bucket if c.isdigit())
    return int(digits) + (1 if bucket.startswith(">") else 0) if digits else 0


def slice_name(row: dict[str, Any]) -> str:
    name = f"{row['domain']}/d{row['difficulty']}/{row['context_bucket']}"
    return f"{name}/trap" if row.get("trap") else name


def weakest(rows: list[dict[str, Any]], min_tasks: int = MIN_SLICE) -> dict[str, Any] | None:
    """The slice with the lowest pass rate (ties: more tasks first, then by name)."""
    big = [r for r in rows if r["tasks"] >= min_tasks] or rows
    if not big:
        return None
    return min(big, key=lambda r: (r["pass_rate"], -r["tasks"], slice_name(r)))


SLICE_WIDTH_IN = 0.16
"""Inches of the report plot's width per slice once the slices fill its 9-inch panel (56 or
more): the slices' panel, and the figure, grow with their count."""


def plot(rows: list[dict[str, Any]]):
    """A matplotlib figure: per-domain pass rate (left), every slice (right; 9 inches wide,
    wider by ``SLICE_WIDTH_IN`` a slice beyond 56, so the 7-pt labels stay apart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_domain: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        by_domain[r["domain"]][0] += r["passed"]
        by_domain[r["domain"]][1] += r["tasks"]
    wide = max(9.0, SLICE_WIDTH_IN * len(rows))  # the slices' panel grows with them: labels never overlap
    fig, (left, right) = plt.subplots(1, 2, figsize=(3.0 + wide, 4), gridspec_kw={"width_ratios": [3.0, wide]})
    domains = sorted(by_domain)
    left.bar(domains, [by_domain[d][0] / by_domain[d][1] for d in domains], color="tab:blue")
    left.set_ylim(0, 1)
    left.set_ylabel("pass@1")
    left.set_title("by domain")
    left.tick_params(axis="x", rotation=45)
    names = [slice_name(r) for r in rows]
    rates = np.array([r["pass_rate"] for r in rows])
    spread = np.clip([rates - [r["ci_low"] for r in rows], [r["ci_high"] for r in rows] - rates], 0, 1) if rows else None
    right.bar(range(len(rows)), rates, color="tab:orange", yerr=spread, ecolor="grey", capsize=2)
    right.set_xticks(range(len(rows)), names, rotation=75, fontsize=7, ha="right", rotation_mode="anchor")
    right.set_xlim(-0.6, len(rows) - 0.4)  # not matplotlib's 5% margins: 4 slices' room on each side at 85
    right.set_ylim(0, 1)
    right.set_ylabel("pass@1")
    right.set_title("by domain / difficulty / context bucket")
    fig.tight_layout()
    return fig


def log_layered(ctx, results: list[EvalResult]) -> Slice | None:
    """Write and log the layered table and plot; returns the weakest slice."""
    import pandas as pd

    from components.core import tracking

    rows = slices(results, ctx.recipe.evaluation.confidence)
    ctx.write_json("layered", rows)
    worst = weakest(rows)
    run_id = ctx.mlflow_run_id
    if run_id:
        try:
            client = tracking.client()
            client.log_table(run_id, pd.DataFrame(rows), f"{ctx.stage}/layered.json")
            if rows:
                import matplotlib.pyplot as plt

                fig = plot(rows)
                try:
                    client.log_figure(run_id, fig, f"{ctx.stage}/pass_rates.png")
                finally:
                    plt.close(fig)
        except Exception as exc:  # noqa: BLE001 - a lasting artifact-store error must not fail the stage on every rerun
            say(f"iter {ctx.iteration} | {ctx.stage} | layered table or plot not logged to MLflow ({exc_line(exc)[:200]}); "
                f"the table is in the store ({ctx.outputs['layered'].path})")
    if worst is None:
        return None
    return Slice(name=slice_name(worst), **{k: v for k, v in worst.items() if k in Slice.__dataclass_fields__})
