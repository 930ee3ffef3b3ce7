"""An iteration's headline metrics, over iterations: what a reviewer reads first in MLflow.

When an iteration ends (``runner._end_iteration``, after evaluation), ``record`` reads its
manifests from the store and logs, with ``step`` = the iteration, on the iteration's
parent run and on the pipeline's summary run (``<pipeline> · timeline``, one per
pipeline and run root, ``tracking.pipeline_run``; the iteration runs nest under it;
the summary run also gets bootstrap's ``pass_at_1/*`` as step 0):

| metric | from |
|---|---|
| ``pass_at_1/<domain>``, ``pass_at_1/mean`` | evaluation's ``<domain>/pass_at_1``, ``mean/pass_at_1`` |
| ``promoted`` | evaluation's ``promoted`` (1 or 0) |
| ``reward/<domain>`` | the mean raw reward of the rewards not excluded, over all reward shards |
| ``groups_kept`` | trainer's ``groups`` (groups with a learning signal) |
| ``trainer/loss``, ``trainer/kl`` | trainer's ``loss``, ``kl`` |
| ``sandbox/<status>`` | sandbox's ``status/<status>`` counts, summed over shards |

and the plot ``timeline/pass_rates.png`` on both runs: eval pass@1 per domain over
iterations 0..k (0 is bootstrap's score of the base policy; earlier iterations are read
from their evaluation manifests) with 95% Wilson score bands, n being the suite's tasks
per domain (its ``eval_results`` rows over the domains); and ``timeline/rewards.png``:
the mean raw training reward per domain over iterations 1..k (``reward/<domain>``, the
reward curve), left out while no iteration has rewards. On the iteration's run k is the
iteration; on the summary run it is the latest finished iteration (the largest with an
evaluation manifest), so re-running a stage of an older iteration (``posttrain stage
evaluation --iteration 1`` after iteration 2, Airflow clearing an old run) redraws the
summary's plots whole instead of cutting them at that iteration.

Idempotent: a metric whose value at the step is the one logged last there (by
timestamp) is not logged again (a rerun that hits the cache ends the iteration a second
time, and adds nothing); one whose value changed (a re-run stage) is logged again at the
same step, stamped after the old one, so it is the latest; the old value stays in the
metric's history (MLflow deletes no single value). The plots are overwritten. A metric
whose stage did not record it (an older manifest) is left out.
An error while drawing or uploading a plot (an artifact store that refuses writes)
prints one line per plot and is not raised: the metrics are logged before them.
An iteration run deleted in the MLflow UI takes nothing: the iteration's live parent run
(found by its tags, or made) gets its metrics and plots instead.

    from components.core import timeline
    timeline.headline(store, "tiny", 2)  # {"pass_at_1/code": 0.25, "reward/code": 0.4, ...}

Not covered: iterations run under another run root (each run root has its own summary
run), statistical tests between iterations (the bands are per iteration), and a metric
a re-run no longer produces (a domain dropped from the recipe): its old value stays at
the step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from components.core import planner, tracking
from components.core.context import read_manifest, read_manifests, read_output_json
from components.core.errors import exc_line
from components.core.facts import Decision, Scored, StatsFile
from components.core.intervals import wilson
from components.core.manifest import Manifest, stage_prefix
from components.core.progress import say
from components.core.storage import Store

PLOT = "timeline/pass_rates.png"
REWARD_PLOT = "timeline/rewards.png"


@dataclass(frozen=True)
class Scores:
    """One point of the pass-rate timeline: an iteration's eval pass@1 per domain."""

    iteration: int
    pass_rates: dict[str, float]
    tasks_per_domain: int  # 0 when the manifest does not say (no band is drawn)


def _metrics(m: Manifest) -> dict[str, float]:
    """A manifest's metrics without the ``<stage>/`` prefix."""
    return {k.split("/", 1)[1]: float(v) for k, v in m.metrics.items() if "/" in k}


def _reward_means(store: Store, shards: list[Manifest]) -> dict[str, float]:
    """Mean raw reward per domain over every shard: each shard's ``norm_stats`` output has
    its per-domain count and mean ("batch"); without it, shard means weighted by rewards."""
    sums: dict[str, list[float]] = {}
    for m in shards:
        batch = None
        if "norm_stats" in m.outputs:
            batch = read_output_json(store, m, "norm_stats", StatsFile).get("batch")
        if batch:
            for domain, stats in batch.items():
                acc = sums.setdefault(domain, [0.0, 0.0])
                acc[0] += float(stats["mean"]) * float(stats["count"])
                acc[1] += float(stats["count"])
            continue
        metrics = _metrics(m)
        weight = metrics.get("rewards", 1.0)
        for key, value in metrics.items():
            domain, _, name = key.partition("/")
            if name == "mean":
                acc = sums.setdefault(domain, [0.0, 0.0])
                acc[0] += value * weight
                acc[1] += weight
    return {d: s / n for d, (s, n) in sorted(sums.items()) if n > 0}


def headline(store: Store, pipeline: str, iteration: int) -> dict[str, float]:
    """The iteration's headline metrics (see the module docstring) from its manifests."""
    out: dict[str, float] = {}
    evaluation = read_manifest(store, stage_prefix(pipeline, iteration, "evaluation"))
    if evaluation is not None:
        for key, value in _metrics(evaluation).items():
            domain, _, name = key.partition("/")
            if name == "pass_at_1":
                out[f"pass_at_1/{domain}"] = value
        if "promoted" in (metrics := _metrics(evaluation)):
            out["promoted"] = metrics["promoted"]
    if store.exists(stage_prefix(pipeline, iteration, "reward")):
        out.update({f"reward/{d}": v for d, v in _reward_means(store, read_manifests(store, pipeline, iteration, "reward")).items()})
    trainer = read_manifest(store, stage_prefix(pipeline, iteration, "trainer"))
    if trainer is not None:
        metrics = _metrics(trainer)
        for name, key in (("groups", "groups_kept"), ("loss", "trainer/loss"), ("kl", "trainer/kl")):
            if name in metrics:
                out[key] = metrics[name]
    if store.exists(stage_prefix(pipeline, iteration, "sandbox")):
        for m in read_manifests(store, pipeline, iteration, "sandbox"):
            for key, value in _metrics(m).items():
                if key.startswith("status/"):
                    name = f"sandbox/{key[len('status/'):]}"
                    out[name] = out.get(name, 0.0) + value
    return dict(sorted(out.items()))


def _scores(m: Manifest, iteration: int) -> Scores:
    """The pass rates of a bootstrap (``Scored``) or evaluation (``Decision``) manifest, read
    through its typed facts: a UserError naming the manifest when they are not numbers."""
    rates = dict(m.facts(Scored if m.stage == "bootstrap" else Decision).pass_rates)
    results = m.outputs.get("eval_results")
    n = results.rows // len(rates) if results is not None and rates else 0
    return Scores(iteration, rates, n)


def history(store: Store, pipeline: str, upto: int) -> list[Scores]:
    """Eval pass rates of iterations 0 (bootstrap) .. ``upto`` that have them."""
    out = []
    for k in range(upto + 1):
        m = read_manifest(store, stage_prefix(pipeline, k, "bootstrap" if k == 0 else "evaluation"))
        if m is not None and m.info.get("pass_rates"):
            out.append(_scores(m, k))
    return out


def reward_history(store: Store, pipeline: str, upto: int) -> list[tuple[int, dict[str, float]]]:
    """``(iteration, mean raw reward per domain)`` of iterations 1 .. ``upto`` that have rewards."""
    out = []
    for k in range(1, upto + 1):
        if store.exists(stage_prefix(pipeline, k, "reward")):
            means = _reward_means(store, read_manifests(store, pipeline, k, "reward"))
            if means:
                out.append((k, means))
    return out


MAX_TICKED_ITERATIONS = 15
"""Up to this many iterations, the plots label each one; beyond, about ten integer ticks."""


def _iteration_ticks(ax, iterations: list[int]) -> None:
    """One x tick per iteration while they fit (``MAX_TICKED_ITERATIONS``); beyond, matplotlib's
    integer ticks, so the labels of a long-running pipeline do not run into each other."""
    distinct = sorted(set(iterations))
    if len(distinct) <= MAX_TICKED_ITERATIONS:
        ax.set_xticks(distinct)
        return
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_rewards(points: list[tuple[int, dict[str, float]]], pipeline: str):
    """A matplotlib figure: the mean raw training reward per domain over iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for domain in sorted({d for _, means in points for d in means}):
        mine = [(k, means[domain]) for k, means in points if domain in means]
        ax.plot([k for k, _ in mine], [v for _, v in mine], marker="o", label=domain)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean training reward")
    _iteration_ticks(ax, [k for k, _ in points])
    ax.set_title(f"{pipeline}: mean reward of the trained samples by domain")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def plot(points: list[Scores], pipeline: str):
    """A matplotlib figure: pass@1 per domain over iterations, with 95% Wilson bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for domain in sorted({d for p in points for d in p.pass_rates}):
        mine = [p for p in points if domain in p.pass_rates]
        xs = [p.iteration for p in mine]
        rates = [p.pass_rates[domain] for p in mine]
        line, = ax.plot(xs, rates, marker="o", label=domain)
        sized = [p for p in mine if p.tasks_per_domain]
        low, high = wilson([p.pass_rates[domain] * p.tasks_per_domain for p in sized],
                           [p.tasks_per_domain for p in sized], 0.95)
        banded = list(zip([p.iteration for p in sized], low, high))
        if banded:
            ax.fill_between([b[0] for b in banded], [b[1] for b in banded], [b[2] for b in banded],
                            color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xlabel("iteration (0: bootstrap)")
    ax.set_ylabel("eval pass@1")
    ax.set_ylim(-0.02, 1.02)  # a domain at 0 or 1 stays visible, off the frame
    _iteration_ticks(ax, [p.iteration for p in points])
    ax.set_title(f"{pipeline}: eval pass@1 by domain, 95% Wilson bands")
    if points:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def log_changed(run_id: str, metrics: dict[str, float], step: int) -> dict[str, float]:
    """Log, at ``step`` of ``run_id``, each of ``metrics`` whose value there differs from the
    one logged last at that step (by timestamp, as ``get_metric_history`` orders them), or
    that has none there; returns what it logged. The new values are stamped after the
    ones they replace, so they are the latest at that step (and the run's latest value
    when ``step`` is its last). The replaced values stay in the metric's history: MLflow
    deletes no single value. A run that is not ``tracking.live`` (deleted in the UI, which
    refuses every write to it) gets nothing."""
    c = tracking.client()
    if not tracking.live(run_id):
        return {}
    changed: dict[str, float] = {}
    after = 0
    for key, value in metrics.items():
        there = [m for m in c.get_metric_history(run_id, key) if m.step == step]
        last = max(there, key=lambda m: (m.timestamp, m.value), default=None)
        if last is None or not _same(float(last.value), float(value)):
            changed[key] = value
            after = max(after, last.timestamp + 1 if last is not None else 0)
    if changed:
        tracking.log_metrics(run_id, changed, step=step, timestamp_ms=max(after, int(time.time() * 1000)))
    return changed


def _log_plot(runs: list[str], path: str, iteration: int, draw) -> None:
    """``draw()``'s figure as the artifact ``path`` of every run (nothing when it returns
    None); an error prints one line and is not raised."""
    import matplotlib.pyplot as plt

    try:
        fig = draw()
        if fig is None:
            return
        try:
            for run_id in runs:
                tracking.client().log_figure(run_id, fig, path)
        finally:
            plt.close(fig)
    except Exception as exc:  # noqa: BLE001 - a lasting artifact-store error must not fail every rerun
        say(f"iter {iteration} | timeline | plot {path} not logged ({exc_line(exc)[:200]}); its metrics are")


def latest_finished(store: Store, pipeline: str) -> int:
    """The largest iteration with an evaluation manifest (0 when none has one)."""
    return max(planner.finished(store, pipeline), default=0)


def record(store: Store, pipeline: str, iteration: int, parent_run_id: str) -> dict[str, float]:
    """Log iteration ``iteration``'s headline metrics and the plots on its parent run
    (when given) and on the pipeline's summary run; returns the metrics. The parent's
    plots show iterations up to ``iteration``, the summary run's up to the latest
    finished one (``latest_finished``, at least ``iteration``): re-running an older
    iteration's stage does not cut the summary's plots short. A parent run that is gone
    (deleted in the UI, or unknown here) is replaced by the iteration's live parent,
    found by its tags or created (``tracking.live_iteration_run``)."""
    metrics = headline(store, pipeline, iteration)
    if parent_run_id:
        parent_run_id = tracking.live_iteration_run(parent_run_id, pipeline, iteration, store.uri)
    summary = tracking.pipeline_run(pipeline, store.uri)
    latest = max(iteration, latest_finished(store, pipeline))
    plots: dict[int, list[str]] = {iteration: [parent_run_id] if parent_run_id else []}
    plots.setdefault(latest, []).append(summary)
    points = {upto: history(store, pipeline, upto) for upto, runs in plots.items() if runs}
    start = next((p for p in points[latest] if p.iteration == 0), None)
    if start is not None and start.pass_rates:
        # the base policy's scores as step 0, so the charts start where training started
        rates = {f"pass_at_1/{d}": v for d, v in start.pass_rates.items()}
        rates["pass_at_1/mean"] = sum(start.pass_rates.values()) / len(start.pass_rates)
        log_changed(summary, rates, 0)
    for run_id in (r for r in (parent_run_id, summary) if r):
        log_changed(run_id, metrics, iteration)
    for upto, runs in plots.items():
        if not runs:
            continue
        _log_plot(runs, PLOT, iteration, lambda upto=upto: plot(points[upto], pipeline))

        def rewards(upto: int = upto):
            found = reward_history(store, pipeline, upto)
            return plot_rewards(found, pipeline) if found else None

        _log_plot(runs, REWARD_PLOT, iteration, rewards)
    return metrics
