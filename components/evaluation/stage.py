"""Stage ``evaluation``: score the candidate on the fixed suite; promote or hold.

The candidate (this iteration's checkpoint) is evaluated greedily on the fixed held-out
suite. Its per-domain pass rates are compared with those of the current ``champion``
(recorded on that registry version by bootstrap or an earlier evaluation) — the policy
the iteration started from by default, but not when ``rollout.policy: candidate`` keeps
training on from held candidates: a candidate is never measured against a weaker held
one. The candidate becomes ``champion`` only if no domain dropped by more than
``evaluation.regression_tolerance``; the decision and the reason are written to the
report, the manifest and the registry version's tags.

The baseline (the champion's version and pass rates) is fixed at iteration start, before
any alias can move, and recorded in taskgen's manifest (``StartingPolicy``); evaluation
reads it from there. So an evaluation killed after it moved the alias and before its
manifest, then run again, gives the same report and aliases as an uninterrupted one
(it does not compare the candidate with itself). The baseline version is also tagged
on the candidate's registry version (``posttrain.baseline_version``); iterations whose
taskgen manifest predates the field fall back to that tag.

Not covered: statistical significance tests on the difference (the suite is fixed and
greedy, so the same policy always gets the same score).
"""

from __future__ import annotations

import dataclasses

from components.core import models, tracking
from components.core.context import StageContext
from components.core.facts import Checkpoint, Decision, StartingPolicy
from components.core.policy import load_policy
from components.core.progress import say
from components.evalsuite.score import eval_tags, evaluate_and_log, tagged_rates

SECTIONS = ("evaluation", "rollout", "sandbox")
"""Recipe sections read: the suite's size and generation settings, the engine, the sandbox."""


def baseline_rates(pipeline: str, version: str) -> dict[str, float]:
    return tagged_rates(tracking.client().get_model_version(models.model_name(pipeline), version).tags)


def baseline_for(pipeline: str, parent_version: str) -> tuple[str, dict[str, float]]:
    """(version, per-domain pass rates) a candidate must not fall below: the champion's,
    or the parent's while no champion is set."""
    champion = models.resolve_alias(pipeline, "champion")
    version = champion[0] if champion else parent_version
    return version, baseline_rates(pipeline, version)


BASELINE_TAG = "posttrain.baseline_version"


def fixed_baseline(pipeline: str, candidate: str, parent_version: str) -> tuple[str, dict[str, float]]:
    """``baseline_for``, fixed on the candidate's registry version before any alias moves:
    a retry after the first attempt promoted the candidate (a kill, an outage) reads the
    tag back instead of comparing the candidate with itself."""
    tags = tracking.client().get_model_version(models.model_name(pipeline), candidate).tags
    if BASELINE_TAG in tags:
        return tags[BASELINE_TAG], baseline_rates(pipeline, tags[BASELINE_TAG])
    version, rates = baseline_for(pipeline, parent_version)
    models.set_version_tags(pipeline, candidate, {BASELINE_TAG: version})
    return version, rates


def iteration_baseline(ctx: StageContext, trainer: Checkpoint) -> tuple[str, dict[str, float]]:
    """The baseline taskgen fixed at iteration start (``StartingPolicy``), read from its
    manifest; for manifests written before taskgen recorded it, ``fixed_baseline``."""
    start = ctx.facts_of("taskgen", StartingPolicy)
    if not start.baseline_version:
        return fixed_baseline(ctx.pipeline, trainer.version, trainer.parent_version)
    rates = dict(start.baseline_pass_rates) or baseline_rates(ctx.pipeline, start.baseline_version)
    models.set_version_tags(ctx.pipeline, trainer.version, {BASELINE_TAG: start.baseline_version})
    return start.baseline_version, rates


def decide(candidate: dict[str, float], baseline: dict[str, float], tolerance: float) -> tuple[bool, str]:
    drops = {d: baseline[d] - candidate.get(d, 0.0) for d in baseline}
    worst = [f"{d} {baseline[d]:.3f}->{candidate.get(d, 0.0):.3f}" for d, drop in sorted(drops.items()) if drop > tolerance]
    if worst:
        return False, "regressed beyond tolerance: " + ", ".join(worst)
    return True, "no domain regressed beyond tolerance"


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("trainer")


def run(ctx: StageContext) -> dict[str, float]:
    trainer = ctx.facts_of("trainer", Checkpoint)
    candidate = load_policy(trainer.checkpoint_uri, trainer.version)
    _, rates, worst = evaluate_and_log(ctx, candidate)
    baseline_version, baseline = iteration_baseline(ctx, trainer)
    promoted, reason = decide(rates, baseline, ctx.recipe.evaluation.regression_tolerance)
    models.set_version_tags(ctx.pipeline, trainer.version, {**eval_tags(rates), "posttrain.promoted": str(promoted)})
    if promoted:
        models.set_alias(ctx.pipeline, "champion", trainer.version)
    ctx.facts = Decision(version=trainer.version, pass_rates=rates, weakest_slice=worst, promoted=promoted,
                         reason=reason, baseline=baseline, baseline_version=baseline_version)
    ctx.write_json("report", {"candidate": trainer.version, "baseline": baseline_version,
                              "parent": trainer.parent_version, "pass_rates": rates,
                              "baseline_pass_rates": baseline, "promoted": promoted, "reason": reason,
                              "weakest_slice": dataclasses.asdict(worst) if worst else None})
    say(f"iter {ctx.iteration} | evaluation | " + " ".join(f"{d} {v:.3f}" for d, v in rates.items())
        + (f" | weakest {worst.name} {worst.pass_rate:.3f}" if worst else "")
        + f" | {'promoted' if promoted else 'held'}: {reason}")
    metrics = {f"{d}/pass_at_1": v for d, v in rates.items()}
    metrics["mean/pass_at_1"] = sum(rates.values()) / max(1, len(rates))
    metrics["promoted"] = float(promoted)
    return metrics
