"""Score a policy on the fixed suite inside a stage: results, layered report, samples.

``evaluate_and_log(ctx, policy)`` runs the suite through the recipe's sandbox backend,
writes ``eval_results`` and ``layered`` as stage outputs, logs the layered table, plot
and a few sample completions per domain to the stage's MLflow run, and returns the
results, per-domain pass rates and the weakest slice. ``eval_tags`` are the registry
version tags (``posttrain.eval.<domain>``) that later promotions compare against.

``scored_results(store, pipeline, version)`` finds the per-task results a registry
version was scored with: those of the stage that scored it (bootstrap's for the version
registered in iteration 0, the evaluation of iteration k for one registered in iteration
k, by the version's ``posttrain.iteration`` tag), read back verified. The statistical
promotion rule pairs a candidate's results with them.
``log_pass_at_k(ctx, policy, k)`` samples k completions per eval task and returns the
unbiased pass@k per domain (``evaluation.pass_k``; greedy pass@1 still decides).

Every scoring records the settings it was scored under (``suite.eval_settings``) in its
manifest's facts (``eval_settings`` of bootstrap's ``Scored``, evaluation's ``Decision``);
``scoring_of`` reads them back (``Scoring.settings``, empty for manifests written before:
unknown), and ``settings_changes`` says how they differ from the recipe's now. A baseline
scored under other settings is re-scored by the evaluation stage (``rescore``) and its
results written as that stage's ``baseline_eval_results`` with the record
``baseline_eval`` (version, settings, suite), which a retried evaluation reuses
(``earlier_rescore``) instead of generating again.

Not covered: results of versions scored under another run root or by other tools.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from components.core import models, tracking
from components.core.context import StageContext, read_manifest, read_output_records
from components.core.errors import InfraError, UserError, exc_line, outage
from components.core.facts import Slice
from components.core.manifest import Manifest, stage_prefix
from components.core.policy import load_policy
from components.core.progress import say
from components.core.records import EvalResult, Task, from_table
from components.core.storage import Store, parquet_table, sha256_bytes
from components.evalsuite.report import log_layered
from components.evalsuite.suite import eval_settings, eval_tasks, pass_rates, run_suite, sampled_pass_at_k
from components.sandbox.executor import get_executor

EVAL_TAG = "posttrain.eval."
SAMPLES_PER_DOMAIN = 8


def eval_tags(rates: dict[str, float]) -> dict[str, str]:
    return {f"{EVAL_TAG}{d}": f"{v:.6f}" for d, v in rates.items()}


def tagged_rates(tags: dict[str, str], version: str = "", pipeline: str = "") -> dict[str, float]:
    """The per-domain pass rates ``eval_tags`` wrote on a registry version. A tag whose
    value is not a finite number in [0, 1] (``nan``, ``n/a``, an edited tag) is a
    ``UserError`` naming the tag and, where the caller gives them, the version and pipeline."""
    rates = {}
    for k, v in tags.items():
        if not k.startswith(EVAL_TAG):
            continue
        try:
            rate = float(v)
        except (TypeError, ValueError):
            rate = math.nan
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            where = f" of version {version}" if version else ""
            where += f" of {models.model_name(pipeline)}" if pipeline else ""
            raise UserError(f"registry tag {k}", v, f"the tag{where} is not a pass rate (a finite number in [0, 1])",
                            "set it to the version's pass rate on that domain, as the manifest facts (pass_rates) of "
                            "the stage that scored it record it")
        rates[k[len(EVAL_TAG):]] = rate
    return rates


def evaluate_and_log(ctx: StageContext, policy) -> tuple[list[EvalResult], dict[str, float], Slice | None]:
    with get_executor(ctx.recipe.sandbox) as executor:
        results = run_suite(policy, eval_tasks(ctx.recipe), ctx.recipe, executor, label=f"{ctx.stage} eval")
    ctx.write_records("eval_results", results, EvalResult)
    worst = log_layered(ctx, results)  # domain x difficulty x context bucket: store, MLflow table + plot
    log_samples(ctx, results)
    return results, pass_rates(results), worst


def log_samples(ctx: StageContext, results: list[EvalResult]) -> None:
    """The first completions of each domain as the MLflow artifact ``<stage>/samples.json``.
    A failed upload prints one line and the stage goes on (a lasting artifact-store error
    failed every rerun); the eval results themselves are in the store."""
    samples: dict[str, list[dict]] = {}
    for r in results:
        mine = samples.setdefault(r.domain, [])
        if len(mine) < SAMPLES_PER_DOMAIN:
            mine.append({"task_id": r.task_id, "completion": r.completion, "passed": r.passed})
    try:
        tracking.log_artifact_text(ctx.mlflow_run_id, json.dumps(samples, indent=2), f"{ctx.stage}/samples.json")
    except Exception as exc:  # noqa: BLE001 - as the layered table's upload (report.log_layered)
        say(f"iter {ctx.iteration} | {ctx.stage} | {ctx.stage}/samples.json not logged to MLflow "
            f"({exc_line(exc)[:200]}); the eval results are in the store")


def log_pass_at_k(ctx: StageContext, policy, k: int) -> dict[str, float]:
    """Unbiased pass@k per domain from ``k`` completions per eval task sampled at
    ``rollout.temperature`` (seeded by the stage); written as the stage output ``pass_at_k``."""
    with get_executor(ctx.recipe.sandbox) as executor:
        rates = sampled_pass_at_k(policy, eval_tasks(ctx.recipe), ctx.recipe, executor, k, ctx.recipe.rollout.temperature,
                                  ctx.seed("pass-at-k"), label=f"{ctx.stage} pass@{k}")
    ctx.write_json("pass_at_k", {"k": k, "temperature": ctx.recipe.rollout.temperature, "pass_at_k": rates})
    return rates


ITERATION_TAG = "posttrain.iteration"
RUN_ROOT_TAG = "posttrain.run_root"


@dataclass(frozen=True)
class Scoring:
    """Where a registry version's eval results are (``manifest``), or why they are not
    (``missing``: a sentence for the decision's reason)."""

    version: str
    manifest: Manifest | None
    missing: str = ""
    # The settings it was scored under (``suite.eval_settings``); empty when its manifest
    # records none (written before they were recorded): unknown.
    settings: dict[str, str] = field(default_factory=dict)


def scoring_of(store: Store, pipeline: str, version: str) -> Scoring:
    """The manifest of the stage that scored ``version`` on the eval suite, found through
    the version's ``posttrain.iteration`` tag; ``missing`` says why when there is none (a
    tag that is not a non-negative integer, an edited one, finds none: the statistical
    rule falls back to strict and its reason names the tag)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = tracking.client().get_model_version(models.model_name(pipeline), str(version)).tags
    except MlflowException:
        return Scoring(version, None, f"version {version} is not in the registry")
    if ITERATION_TAG not in tags:
        return Scoring(version, None, f"version {version} has no {ITERATION_TAG} tag (registered outside the pipeline)")
    if tags.get(RUN_ROOT_TAG, store.uri) != store.uri:
        return Scoring(version, None, f"version {version} was scored under another run root ({tags[RUN_ROOT_TAG]})")
    text = tags[ITERATION_TAG]
    # An edited tag ("three", "1e3", "-1", thousands of digits) is hostile input, as in tagged_rates.
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        return Scoring(version, None, f"version {version}'s {ITERATION_TAG} tag {text!r:.60} is not an iteration "
                                      "(a non-negative integer)")
    iteration = int(text)
    prefix = stage_prefix(pipeline, iteration, "bootstrap" if iteration == 0 else "evaluation")
    manifest = read_manifest(store, prefix)
    if manifest is None or "eval_results" not in manifest.outputs:
        return Scoring(version, None, f"no eval_results of version {version} under {store.url(prefix)}")
    return Scoring(version, manifest, settings=recorded_settings(manifest.info))


def recorded_settings(info: dict) -> dict[str, str]:
    """The ``eval_settings`` a manifest's facts record; {} (unknown) when they record none
    or something that is not a mapping of names to JSON text (an edited manifest)."""
    found = info.get("eval_settings") if isinstance(info, dict) else None
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        return {}
    return dict(found)


def settings_changes(recorded: dict[str, str], current: dict[str, str]) -> str:
    """How the settings a scoring recorded differ from ``current`` (the recipe's now), as
    "evaluation.max_new_tokens 32->256, rollout.prompt_format \"raw\"->\"chat\""; a
    setting it did not record reads "unrecorded"; "" when they agree. A scoring with no
    record at all: "its scoring recorded no eval settings"."""
    if not recorded:
        return "its scoring recorded no eval settings"
    return ", ".join(f"{k} {recorded.get(k, 'unrecorded')}->{v}" for k, v in current.items() if recorded.get(k) != v)


def scored_results(store: Store, scoring: Scoring) -> tuple[list[EvalResult], str]:
    """(results, "") of a found scoring, read verified; ([], why) when they are missing or
    were scored for another version (a stage re-run since)."""
    if scoring.manifest is None:
        return [], scoring.missing
    rows = read_output_records(store, scoring.manifest, "eval_results", EvalResult)
    if any(r.policy_version != scoring.version for r in rows):
        return [], f"the eval_results under {store.url(scoring.manifest.prefix)} are not version {scoring.version}'s"
    return rows, ""


RESCORED = "baseline_eval_results"
RESCORED_RECORD = "baseline_eval"


def suite_digest(tasks: list[Task]) -> str:
    """sha256 of the suite's tasks as scored (ids, prompts, references)."""
    return sha256_bytes(json.dumps([[t.task_id, t.prompt, t.reference] for t in tasks], sort_keys=True,
                                   default=str).encode())


def rescore(ctx: StageContext, version: str, tasks: list[Task]) -> list[EvalResult]:
    """Greedy results of registry version ``version`` of this pipeline on ``tasks`` under
    the recipe's settings now (its checkpoint from the registry, its weights checked)."""
    uri = models.resolve_model_uri(f"models:/{models.model_name(ctx.pipeline)}/{version}", f"baseline version {version}")
    policy = load_policy(uri, version, field=f"baseline version {version}", prompt_format=ctx.recipe.rollout.prompt_format)
    with get_executor(ctx.recipe.sandbox) as executor:
        return run_suite(policy, tasks, ctx.recipe, executor, label=f"{ctx.stage} baseline eval")


def _record(ctx: StageContext, version: str, tasks: list[Task]) -> dict:
    """What an earlier attempt's re-scored results must match to be reused: the version, the
    settings, the suite and the code that scored them (this stage's code version, plug-in
    packages included: a re-run after an upgrade scores the baseline with the new code)."""
    from components.core.runner import stage_code_version

    return {"version": version, "settings": eval_settings(ctx.recipe), "suite": suite_digest(tasks),
            "code": stage_code_version(ctx.recipe.whole, ctx.stage)}


def earlier_rescore(ctx: StageContext, version: str, tasks: list[Task]) -> list[EvalResult] | None:
    """The re-scored results an earlier attempt of this stage left under its prefix (killed
    before its manifest, or re-run), when its record ``baseline_eval`` names the same
    version, settings, suite and code and the results still hold what it recorded; None otherwise."""
    try:
        record = ctx.store.read_json(f"{ctx.prefix}/{RESCORED_RECORD}.json")
        want = _record(ctx, version, tasks)
        if not isinstance(record, dict) or {k: record.get(k) for k in want} != want:
            return None
        data = ctx.store.read_bytes(f"{ctx.prefix}/{RESCORED}.parquet")
        if sha256_bytes(data) != record.get("results_sha256"):
            return None
        rows = from_table(EvalResult, parquet_table(data))
    except Exception as exc:  # noqa: BLE001 - nothing (or nothing usable) there: score again
        if isinstance(exc, InfraError) or outage(exc) is not None:
            raise
        return None
    if [r.task_id for r in rows] != [t.task_id for t in tasks] or any(r.policy_version != version for r in rows):
        return None
    return rows


def write_rescore(ctx: StageContext, version: str, tasks: list[Task], results: list[EvalResult], why: str) -> None:
    """The re-scored baseline as this stage's outputs: ``baseline_eval_results`` and, after
    it, the record ``baseline_eval`` that ``earlier_rescore`` checks."""
    ctx.write_records(RESCORED, results, EvalResult)
    record = _record(ctx, version, tasks)
    ctx.write_json(RESCORED_RECORD, {**record, "why": why, "results_sha256": ctx.outputs[RESCORED].sha256})
