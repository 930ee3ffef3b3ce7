"""Score a policy on the fixed suite inside a stage: results, layered report, samples.

``evaluate_and_log(ctx, policy)`` runs the suite through the recipe's sandbox backend,
writes ``eval_results`` and ``layered`` as stage outputs, logs the layered table, plot
and a few sample completions per domain to the stage's MLflow run, and returns the
results, per-domain pass rates and the weakest slice. ``eval_tags`` are the registry
version tags (``posttrain.eval.<domain>``) that later promotions compare against.

Not covered: sampling-based pass@k (the suite is greedy pass@1).
"""

from __future__ import annotations

import json

from components.core import tracking
from components.core.context import StageContext
from components.core.facts import Slice
from components.core.records import EvalResult
from components.evalsuite.report import log_layered
from components.evalsuite.suite import eval_tasks, pass_rates, run_suite
from components.sandbox.executor import get_executor

EVAL_TAG = "posttrain.eval."
SAMPLES_PER_DOMAIN = 8


def eval_tags(rates: dict[str, float]) -> dict[str, str]:
    return {f"{EVAL_TAG}{d}": f"{v:.6f}" for d, v in rates.items()}


def tagged_rates(tags: dict[str, str]) -> dict[str, float]:
    """The per-domain pass rates ``eval_tags`` wrote on a registry version."""
    return {k[len(EVAL_TAG):]: float(v) for k, v in tags.items() if k.startswith(EVAL_TAG)}


def evaluate_and_log(ctx: StageContext, policy) -> tuple[list[EvalResult], dict[str, float], Slice | None]:
    with get_executor(ctx.recipe.sandbox) as executor:
        results = run_suite(policy, eval_tasks(ctx.recipe), ctx.recipe, executor, label=f"{ctx.stage} eval")
    ctx.write_records("eval_results", results, EvalResult)
    worst = log_layered(ctx, results)  # domain x difficulty x context bucket: store, MLflow table + plot
    samples: dict[str, list[dict]] = {}
    for r in results:
        mine = samples.setdefault(r.domain, [])
        if len(mine) < SAMPLES_PER_DOMAIN:
            mine.append({"task_id": r.task_id, "completion": r.completion, "passed": r.passed})
    tracking.log_artifact_text(ctx.mlflow_run_id, json.dumps(samples, indent=2), f"{ctx.stage}/samples.json")
    return results, pass_rates(results), worst
