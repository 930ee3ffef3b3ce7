"""Stage ``evaluation``: score the candidate on the fixed suite; promote or hold.

The candidate (this iteration's checkpoint) is evaluated greedily on the fixed held-out
suite and compared, domain by domain, with the baseline: the current ``champion`` — the
policy the iteration started from by default, but not when ``rollout.policy: candidate``
keeps training on from held candidates (a candidate is never measured against a weaker
held one).

The rule is ``evaluation.promotion`` (``components.evalsuite.decision``):

- ``statistical`` (default): the baseline's per-task results are read from the store
  (those of the stage that scored it, an input of this stage) and paired with the
  candidate's by task; a domain regresses when the upper bound of the paired-bootstrap
  interval of its pass-rate difference (``evaluation.confidence``,
  ``evaluation.bootstrap_resamples``, seeded from the recipe seed) is below 0. Promoted
  when no domain regresses and the mean pass rate over domains does not drop at all.
  Without the baseline's results it falls back to the strict rule and the reason says
  why. Not covered: an exact test where few tasks differ (the percentile interval is too
  narrow there: 4 of 200 lost, none gained, is held; see ``components.evalsuite.decision``).
- ``strict``: promoted only if no domain dropped by more than
  ``evaluation.regression_tolerance``.

Both judge the recipe's domains the baseline was scored on: a baseline domain the recipe
dropped is left out, a domain only the candidate has is new (reported without a
baseline, blocking nothing; the statistical rule still pairs the others), and the reason
names both. A held candidate that an earlier attempt of this evaluation had promoted
gives the ``champion`` alias back to the baseline version. An external starting policy
(``rollout.policy`` a checkpoint or another model's URI) with no champion set has no
baseline: every domain is new, the candidate is promoted, and the reason says why.

With ``evaluation.pass_k > 0`` it also samples k completions per eval task and logs the
unbiased pass@k per domain (``<domain>/pass_at_k``) beside greedy pass@1; pass@k never
decides. The decision, the rule and why, and the per-domain table (candidate, baseline,
difference, interval) go to ``report.json``, the manifest's facts, and the registry
version (tags and a markdown description with links to the runs, the checkpoint and
the datasets it trained on).

The baseline (the champion's version and pass rates) is fixed at iteration start, before
any alias can move, and recorded in taskgen's manifest (``StartingPolicy``); evaluation
reads it from there. So an evaluation killed after it moved the alias and before its
manifest, then run again, gives the same report and aliases as an uninterrupted one
(it does not compare the candidate with itself). The baseline version is also tagged
on the candidate's registry version (``posttrain.baseline_version``); iterations whose
taskgen manifest predates the field fall back to that tag (and to the strict rule).

The candidate sees its prompts in ``rollout.prompt_format`` (``components.core.prompts``),
as rollout gave them.

Like for like: every scoring records the settings that shape a greedy eval result
(``components.evalsuite.suite.eval_settings``: ``evaluation.max_new_tokens``,
``rollout.prompt_format``, the engine, the episode limits, the sandbox's limits) in its
manifest's facts. When the baseline's scoring recorded other settings than the recipe's
now, or none (a manifest written before they were recorded), this stage re-scores the
baseline version (its registry checkpoint) on the same suite under the recipe's settings
and both rules judge against those results (``rescored_baseline``); the reason and
``report.json`` name the settings and both values, and the results are this stage's
output ``baseline_eval_results`` (a retried evaluation reuses them: greedy, so the
decision is the same either way). Under the same settings nothing more is generated. A
baseline whose results are not found at all is not re-scored: the strict rule on its
tags decides, as above. Not covered: re-scoring a champion held over several iterations
once only (each iteration's evaluation re-scores it again until a candidate scored under
the new settings is promoted); corrections for comparing several domains at once (each
interval is at ``evaluation.confidence`` on its own).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from components.core import models, tracking
from components.core.context import StageContext
from components.core.errors import UserError
from components.core.facts import Checkpoint, Decision, StartingPolicy
from components.core.manifest import MANIFEST, InputRef
from components.core.policy import load_policy
from components.core.progress import say
from components.core.records import EvalResult
from components.evalsuite.decision import (
    BASELINE_TAG,
    Comparison,
    compare,
    missing_pairs,
    record_decision,
    statistical_rule,
    strict_rule,
    unpaired,
)
from components.evalsuite.score import (
    Scoring,
    earlier_rescore,
    eval_tags,
    evaluate_and_log,
    log_pass_at_k,
    rescore,
    scored_results,
    scoring_of,
    settings_changes,
    tagged_rates,
    write_rescore,
)
from components.evalsuite.suite import eval_settings, eval_tasks, pass_rates

SECTIONS = ("evaluation", "rollout", "sandbox")
"""Recipe sections read: the suite's size and generation settings, the engine, the sandbox."""


def baseline_rates(pipeline: str, version: str) -> dict[str, float]:
    tags = tracking.client().get_model_version(models.model_name(pipeline), version).tags
    return tagged_rates(tags, version=version, pipeline=pipeline)


def baseline_for(pipeline: str, parent_version: str) -> tuple[str, dict[str, float]]:
    """(version, per-domain pass rates) a candidate must not fall below: the champion's,
    or the parent's while no champion is set; ("", {}) when there is no champion and the
    parent is not a registry version (``external``: ``rollout.policy`` a checkpoint or
    another model's URI), so every domain is new (no baseline)."""
    champion = models.resolve_alias(pipeline, "champion")
    version = champion[0] if champion else parent_version
    if not version.isdigit():
        return "", {}
    return version, baseline_rates(pipeline, version)


def fixed_baseline(pipeline: str, candidate: str, parent_version: str) -> tuple[str, dict[str, float]]:
    """``baseline_for``, fixed on the candidate's registry version before any alias moves:
    a retry after the first attempt promoted the candidate (a kill, an outage) reads the
    tag back instead of comparing the candidate with itself. No baseline is fixed as an
    empty tag, read back as ("", {})."""
    tags = tracking.client().get_model_version(models.model_name(pipeline), candidate).tags
    if BASELINE_TAG in tags:
        fixed = tags[BASELINE_TAG]
        return (fixed, baseline_rates(pipeline, fixed)) if fixed else ("", {})
    version, rates = baseline_for(pipeline, parent_version)
    models.set_version_tags(pipeline, candidate, {BASELINE_TAG: version})
    return version, rates


def iteration_baseline(ctx: StageContext, trainer: Checkpoint) -> tuple[str, dict[str, float]]:
    """The baseline taskgen fixed at iteration start (``StartingPolicy``), read from its
    manifest; where it records none (manifests written before taskgen recorded it, an
    external starting policy with no champion), ``fixed_baseline``."""
    start = ctx.facts_of("taskgen", StartingPolicy)
    if not start.baseline_version:
        return fixed_baseline(ctx.pipeline, trainer.version, trainer.parent_version)
    rates = dict(start.baseline_pass_rates) or baseline_rates(ctx.pipeline, start.baseline_version)
    models.set_version_tags(ctx.pipeline, trainer.version, {BASELINE_TAG: start.baseline_version})
    return start.baseline_version, rates


def baseline_scoring(ctx: StageContext) -> Scoring | None:
    """Where the baseline's per-task eval results are (None for iterations whose taskgen
    manifest records no baseline version)."""
    start = ctx.facts_of("taskgen", StartingPolicy)
    return scoring_of(ctx.store, ctx.pipeline, start.baseline_version) if start.baseline_version else None


@dataclass(frozen=True)
class Rescored:
    """The baseline re-scored in this stage under the recipe's eval settings now."""

    version: str
    results: list[EvalResult] | None  # None: its checkpoint could not be scored (``failed`` says why)
    why: str  # how its own scoring's settings differ: "evaluation.max_new_tokens 32->256"
    failed: str = ""

    def note(self) -> str:
        if self.results is None:
            return (f"baseline version {self.version} was scored under other eval settings ({self.why}) and could not "
                    f"be re-scored ({self.failed})")
        return f"baseline version {self.version} re-scored under this recipe's eval settings ({self.why})"


def rescored_baseline(ctx: StageContext, baseline_version: str) -> Rescored | None:
    """The baseline's results under the recipe's eval settings when the scoring they were
    found in recorded other settings or none (``Scoring.settings``); None when they agree
    (nothing generated), or when there is no baseline or no scoring of it to pair with
    (the strict fallback says why). Written as ``baseline_eval_results``; an earlier
    attempt's results for the same version, settings and suite are reused."""
    scoring = baseline_scoring(ctx) if baseline_version else None
    if scoring is None or scoring.manifest is None:
        return None
    why = settings_changes(scoring.settings, eval_settings(ctx.recipe))
    if not why:
        return None
    tasks = eval_tasks(ctx.recipe)
    results = earlier_rescore(ctx, scoring.version, tasks)
    if results is None:
        say(f"iter {ctx.iteration} | evaluation | re-scoring baseline version {scoring.version} ({why})")
        try:
            results = rescore(ctx, scoring.version, tasks)
        except UserError as exc:  # its checkpoint deleted or changed since: the strict rule on its tags decides
            say(f"iter {ctx.iteration} | evaluation | baseline version {scoring.version} cannot be re-scored: {exc}")
            return Rescored(scoring.version, None, why, failed=str(exc)[:300])
    else:
        say(f"iter {ctx.iteration} | evaluation | baseline version {scoring.version} re-scored by an earlier attempt "
            f"({why}): reused")
    write_rescore(ctx, scoring.version, tasks, results, why)
    return Rescored(scoring.version, results, why)


NO_BASELINE = "no baseline: the starting policy is external and no champion is set"


def comparisons(ctx: StageContext, results: list[EvalResult], rates: dict[str, float],
                baseline: dict[str, float], baseline_version: str | None = None,
                rescored: Rescored | None = None) -> tuple[list[Comparison], str]:
    """(per-domain rows, "") paired with the baseline's results (``rescored``'s when
    given, else those of the stage that scored it), or (rows without intervals, why) when
    those results are missing or do not cover the candidate's tasks. ``baseline_version``
    "" is no baseline at all (``NO_BASELINE``): every domain is new."""
    if baseline_version == "":
        return unpaired(rates, {}, Counter(r.domain for r in results)), NO_BASELINE
    scoring = baseline_scoring(ctx) if rescored is None else None
    if rescored is not None and rescored.results is None:  # scored under other settings, its checkpoint unusable
        version, base, missing = rescored.version, [], rescored.note()
    elif rescored is not None:
        version, base, missing = rescored.version, rescored.results, ""
    elif scoring is not None:
        version, (base, missing) = scoring.version, scored_results(ctx.store, scoring)
    else:
        version, base, missing = "", [], "taskgen's manifest records no baseline version"
    if not missing and (n := missing_pairs(results, base)):
        missing = f"the results of version {version} lack {n} of the candidate's {len(results)} eval tasks"
    if missing:
        return unpaired(rates, baseline, Counter(r.domain for r in results)), missing
    cfg = ctx.recipe.evaluation
    return compare(results, base, cfg.confidence, cfg.bootstrap_resamples, ctx.seed("promotion")), ""


def decide(ctx: StageContext, rows: list[Comparison], missing: str, rates: dict[str, float],
           baseline: dict[str, float]) -> tuple[str, str, bool, str]:
    """(rule, why that rule, promoted, reason) under ``evaluation.promotion``."""
    cfg = ctx.recipe.evaluation
    domains = list(ctx.recipe.domains)
    if cfg.promotion == "strict":
        return ("strict", "evaluation.promotion is strict", *strict_rule(rates, baseline, cfg.regression_tolerance, domains))
    if missing:
        promoted, reason = strict_rule(rates, baseline, cfg.regression_tolerance, domains)
        return "strict", f"fallback: {missing}", promoted, f"strict rule ({missing}): {reason}"
    paired = sum(r.tasks for r in rows if r.baseline is not None)
    why = f"paired bootstrap over {paired} eval tasks both versions answered"
    return ("statistical", why, *statistical_rule(rows, cfg.confidence, sorted(set(baseline) - set(domains))))


@dataclass(frozen=True)
class Promotion:
    """``promotion``'s decision: the per-domain rows, the rule and why, the verdict."""

    rows: list[Comparison]
    rule: str
    why: str
    promoted: bool
    reason: str
    baseline: dict[str, float]  # the baseline's rates judged against (re-scored ones where it was)
    rescored: Rescored | None


def promotion(ctx: StageContext, results: list[EvalResult], rates: dict[str, float], baseline_version: str,
              baseline: dict[str, float]) -> Promotion:
    """The decision on the candidate's ``results`` against the baseline, like for like: the
    baseline re-scored first where its scoring's settings differ (``rescored_baseline``;
    the rule's why and the reason then say so, naming the settings)."""
    rescored = rescored_baseline(ctx, baseline_version)
    if rescored is not None and rescored.results is not None:
        # the recipe's domains re-scored; a domain it dropped keeps its recorded rate (left out)
        baseline = {**baseline, **pass_rates(rescored.results)}
    rows, missing = comparisons(ctx, results, rates, baseline, baseline_version, rescored)
    rule, why, promoted, reason = decide(ctx, rows, missing, rates, baseline)
    if rescored is not None and rescored.note() not in reason:  # (the fallback's reason already says a failed one)
        why, reason = f"{why}; {rescored.note()}", f"{reason}; {rescored.note()}"
    return Promotion(rows, rule, why, promoted, reason, baseline, rescored)


def settle_champion(pipeline: str, candidate: str, promoted: bool, baseline_version: str) -> None:
    """Point ``champion`` at the candidate when promoted; when held, point it back at the
    baseline if it is on the candidate (an earlier attempt of this evaluation promoted it,
    and this one, re-run on other baseline results or another recipe, holds it). Not
    covered: telling an alias a person moved to the candidate by hand from one an earlier
    attempt moved (both are moved back when the candidate is held)."""
    if promoted:
        models.set_alias(pipeline, "champion", candidate)
        return
    champion = models.resolve_alias(pipeline, "champion")
    if champion and champion[0] == str(candidate) and baseline_version and baseline_version != str(candidate):
        models.set_alias(pipeline, "champion", baseline_version)


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("trainer")
    # The decision depends on the baseline's per-task results: a re-scored baseline re-runs it.
    scoring = baseline_scoring(ctx)
    if scoring is not None and scoring.manifest is not None:
        m = scoring.manifest
        ctx.inputs["baseline_eval"] = InputRef(uri=ctx.store.url(f"{m.prefix}/{MANIFEST}"), digest=m.content_digest)


def run(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.recipe.evaluation
    trainer = ctx.facts_of("trainer", Checkpoint)
    candidate = load_policy(trainer.checkpoint_uri, trainer.version, prompt_format=ctx.recipe.rollout.prompt_format)
    results, rates, worst = evaluate_and_log(ctx, candidate)
    pass_k = log_pass_at_k(ctx, candidate, cfg.pass_k) if cfg.pass_k else {}
    baseline_version, baseline = iteration_baseline(ctx, trainer)
    judged = promotion(ctx, results, rates, baseline_version, baseline)
    rows, rule, why, promoted, reason = judged.rows, judged.rule, judged.why, judged.promoted, judged.reason
    baseline, rescored = judged.baseline, judged.rescored
    models.set_version_tags(ctx.pipeline, trainer.version, eval_tags(rates))  # the decision: record_decision below
    trained = ctx.upstream("trainer")[0]
    described = record_decision(ctx.pipeline, trainer.version, promoted=promoted, reason=reason, rows=rows,
                    baseline_version=baseline_version, parent_version=trainer.parent_version, run_id=trained.mlflow_run_id,
                    evaluation_run_id=ctx.mlflow_run_id, parent_run_id=ctx.parent_run_id,
                    checkpoint_uri=trainer.checkpoint_uri, datasets={k: v.uri for k, v in trained.inputs.items()})
    settle_champion(ctx.pipeline, trainer.version, promoted, baseline_version)
    ctx.facts = Decision(version=trainer.version, pass_rates=rates, weakest_slice=worst, promoted=promoted,
                         reason=reason, baseline=baseline, baseline_version=baseline_version, rule=rule,
                         eval_settings=eval_settings(ctx.recipe),
                         baseline_rescored=rescored.why if rescored and rescored.results is not None else "")
    report = {"candidate": trainer.version, "baseline": baseline_version,
              "parent": trainer.parent_version, "pass_rates": rates,
              "baseline_pass_rates": baseline, "promoted": promoted, "reason": reason,
              "rule": rule, "rule_why": why, "confidence": cfg.confidence,
              "baseline_rescored": {"version": rescored.version, "why": rescored.why, "failed": rescored.failed,
                                    "settings": eval_settings(ctx.recipe)} if rescored else None,
              "domains": {r.domain: {k: v for k, v in dataclasses.asdict(r).items() if k != "domain"}
                          for r in rows},
              "pass_at_k": {"k": cfg.pass_k, "rates": pass_k} if cfg.pass_k else None,
              "weakest_slice": dataclasses.asdict(worst) if worst else None}
    ctx.write_json("report", report)
    # On the evaluation run too: the decision as its description, the report as an artifact.
    tracking.client().set_tag(ctx.mlflow_run_id, "mlflow.note.content", described)
    tracking.client().log_dict(ctx.mlflow_run_id, report, f"{ctx.stage}/report.json")
    say(f"iter {ctx.iteration} | evaluation | " + " ".join(f"{d} {v:.3f}" for d, v in rates.items())
        + (f" | weakest {worst.name} {worst.pass_rate:.3f}" if worst else "")
        + f" | {'promoted' if promoted else 'held'} ({rule}): {reason}")
    metrics = {f"{d}/pass_at_1": v for d, v in rates.items()}
    metrics["mean/pass_at_1"] = sum(rates.values()) / max(1, len(rates))
    metrics.update({f"{d}/pass_at_k": v for d, v in pass_k.items()})
    if pass_k:
        metrics["mean/pass_at_k"] = sum(pass_k.values()) / len(pass_k)
    metrics.update({f"{r.domain}/diff_ci_high": r.ci_high for r in rows if r.ci_high is not None})
    metrics["promoted"] = float(promoted)
    return metrics
